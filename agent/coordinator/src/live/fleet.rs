//! This coordinator's place in its fleet: the address it advertises once it serves, and every
//! coordinator serving the same store now (this one included), as the store last said. Sessions
//! watch the members and tell their node whenever the set changes.
use std::sync::OnceLock;
use tokio::sync::watch;

pub(crate) struct FleetView {
    address: OnceLock<String>,
    /// A coordinator heard within this long serves the fleet (the lease, set with the address).
    heard_within: OnceLock<std::time::Duration>,
    /// How many coordinators hold content imported through this one before `run` returns.
    content_copies: OnceLock<usize>,
    members: watch::Sender<Vec<String>>,
}

impl Default for FleetView {
    fn default() -> Self {
        FleetView {
            address: OnceLock::new(),
            heard_within: OnceLock::new(),
            content_copies: OnceLock::new(),
            members: watch::Sender::new(Vec::new()),
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
