//! This coordinator's place in its fleet: the address it advertises once it serves, and every
//! coordinator serving the same store now (this one included), as the store last said.
use super::guarded::Guarded;
use std::sync::OnceLock;

#[derive(Default)]
pub(crate) struct FleetView {
    address: OnceLock<String>,
    members: Guarded<Vec<String>>,
}

impl FleetView {
    /// The advertised `host:port`, set once when `serve` starts.
    pub(crate) fn serve_at(&self, address: &str) {
        let _ = self.address.set(address.to_string());
    }

    pub(crate) fn address(&self) -> Option<&str> {
        self.address.get().map(String::as_str)
    }

    /// The coordinators the store says serve it now, in the store's order.
    pub(crate) fn heard(&self, members: Vec<String>) {
        *self.members.lock() = members;
    }

    pub(crate) fn members(&self) -> Vec<String> {
        self.members.lock().clone()
    }

    /// The members other than `address`.
    pub(crate) fn others_than(&self, address: &str) -> Vec<String> {
        (self.members.lock().iter())
            .filter(|a| *a != address)
            .cloned()
            .collect()
    }

    /// The other coordinators serving the same store now.
    pub(crate) fn peers(&self) -> Vec<String> {
        let own = self.address();
        (self.members.lock().iter())
            .filter(|a| Some(a.as_str()) != own)
            .cloned()
            .collect()
    }

    /// Whether this coordinator sweeps the fleet's runs: the first by the store's order of those
    /// serving it now (or the only one).
    pub(crate) fn sweeps(&self) -> bool {
        self.members
            .lock()
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
        fleet.serve_at("b:1");
        fleet.heard(vec!["a:1".into(), "b:1".into(), "c:1".into()]);
        assert!(!fleet.sweeps());
        assert_eq!(fleet.peers(), ["a:1", "c:1"]);
        assert_eq!(fleet.others_than("c:1"), ["a:1", "b:1"]);
        fleet.heard(vec!["b:1".into(), "c:1".into()]);
        assert!(fleet.sweeps(), "once a:1 is gone, b:1 takes over");
    }
}
