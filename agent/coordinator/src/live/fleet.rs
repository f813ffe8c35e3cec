//! This coordinator's place in its fleet: the address it advertises once it serves, and every
//! coordinator serving the same store now (this one included), as the store last said. Sessions
//! watch the members and tell their node whenever the set changes.
use std::sync::OnceLock;
use tokio::sync::{MutexGuard, watch};

pub(crate) struct FleetView {
    address: OnceLock<String>,
    /// A coordinator heard within this long serves the fleet (the lease, set with the address).
    heard_within: OnceLock<std::time::Duration>,
    /// How many coordinators hold content imported through this one before `run` returns.
    content_copies: OnceLock<usize>,
    members: watch::Sender<Vec<String>>,
    /// Reads of the members from the store begun, one at a time: a session opening while one
    /// is under way waits for the next rather than adding its own.
    reads: std::sync::atomic::AtomicU64,
    read_turn: tokio::sync::Mutex<()>,
}

impl Default for FleetView {
    fn default() -> Self {
        FleetView {
            address: OnceLock::new(),
            heard_within: OnceLock::new(),
            content_copies: OnceLock::new(),
            members: watch::Sender::new(Vec::new()),
            reads: Default::default(),
            read_turn: Default::default(),
        }
    }
}

impl FleetView {
    /// The advertised `host:port`, and how recently a member must have been heard (the lease),
    /// set once when `serve` starts.
    pub(crate) fn serve_at(&self, address: &str, heard_within: std::time::Duration) {
        let _ = self.address.set(address.to_string());
        let _ = self.heard_within.set(heard_within);
    }

    /// Content imported here is held by this many coordinators (this one included) before a
    /// run is recorded, set once when `serve` starts; 1 (this one alone) until then.
    pub(crate) fn hold_copies(&self, copies: usize) {
        let _ = self.content_copies.set(copies.max(1));
    }

    pub(crate) fn content_copies(&self) -> usize {
        self.content_copies.get().copied().unwrap_or(1)
    }

    /// How recently a member must have been heard; None before `serve`.
    pub(crate) fn heard_within(&self) -> Option<std::time::Duration> {
        self.heard_within.get().copied()
    }

    pub(crate) fn address(&self) -> Option<&str> {
        self.address.get().map(String::as_str)
    }

    /// The coordinators the store says serve it now, in the store's order; the sessions watching
    /// hear of it only when the set changed.
    pub(crate) fn heard(&self, members: Vec<String>) {
        self.members.send_if_modified(|held| {
            let changed = *held != members;
            *held = members;
            changed
        });
    }

    /// Reads of the members begun so far.
    pub(crate) fn reads_begun(&self) -> u64 {
        self.reads.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The turn to read the members, asked when `asked` reads had begun; None when a read begun
    /// since has ended meanwhile (reads take turns), whose members are as fresh as asked.
    pub(crate) async fn read_turn_after(&self, asked: u64) -> Option<MutexGuard<'_, ()>> {
        let turn = self.read_turn.lock().await;
        if self.reads_begun() > asked {
            return None;
        }
        // Only while holding the turn: a count an asker read is never taken back.
        self.reads.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Some(turn)
    }

    pub(crate) fn members(&self) -> Vec<String> {
        self.members.borrow().clone()
    }

    /// Wakes when the set of members changes.
    pub(crate) fn watch(&self) -> watch::Receiver<Vec<String>> {
        self.members.subscribe()
    }

    /// The members other than `address`.
    pub(crate) fn others_than(&self, address: &str) -> Vec<String> {
        (self.members.borrow().iter())
            .filter(|a| *a != address)
            .cloned()
            .collect()
    }

    /// The other coordinators serving the same store now.
    pub(crate) fn peers(&self) -> Vec<String> {
        let own = self.address();
        (self.members.borrow().iter())
            .filter(|a| Some(a.as_str()) != own)
            .cloned()
            .collect()
    }

    /// Whether this coordinator sweeps the fleet's runs: the first by the store's order of those
    /// serving it now (or the only one).
    pub(crate) fn sweeps(&self) -> bool {
        self.members
            .borrow()
            .first()
            .is_none_or(|first| Some(first.as_str()) == self.address())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_read_begun_after_the_ask_serves_it_and_one_begun_before_does_not() {
        let fleet = FleetView::default();
        let asked = fleet.reads_begun();
        let turn = fleet.read_turn_after(asked).await;
        assert!(turn.is_some(), "no read since: this asker reads");
        // One who asked at the same moment waits for that read, which began after it asked.
        let waiting = fleet.read_turn_after(asked);
        drop(turn);
        assert!(waiting.await.is_none(), "served by the read begun since");
        let now = fleet.reads_begun();
        assert!(
            fleet.read_turn_after(now).await.is_some(),
            "no read since now"
        );
    }

    #[test]
    fn the_first_member_sweeps_and_the_rest_are_peers() {
        let fleet = FleetView::default();
        assert!(
            fleet.sweeps(),
            "alone, before any member is known, it sweeps"
        );
        fleet.serve_at("b:1", std::time::Duration::from_secs(10));
        fleet.heard(vec!["a:1".into(), "b:1".into(), "c:1".into()]);
        assert!(!fleet.sweeps());
        assert_eq!(fleet.peers(), ["a:1", "c:1"]);
        assert_eq!(fleet.others_than("c:1"), ["a:1", "b:1"]);
        fleet.heard(vec!["b:1".into(), "c:1".into()]);
        assert!(fleet.sweeps(), "once a:1 is gone, b:1 takes over");
    }

    #[test]
    fn a_watcher_hears_only_a_changed_set() {
        let fleet = FleetView::default();
        let mut watching = fleet.watch();
        fleet.heard(vec!["a:1".into()]);
        assert!(watching.has_changed().unwrap());
        assert_eq!(*watching.borrow_and_update(), ["a:1"]);
        fleet.heard(vec!["a:1".into()]);
        assert!(
            !watching.has_changed().unwrap(),
            "the same set again is no change"
        );
        fleet.heard(vec!["a:1".into(), "b:1".into()]);
        assert!(watching.has_changed().unwrap());
    }
}
