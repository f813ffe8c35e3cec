//! The agent's one way out: the pinned dial of `fleet_proto::dial` with the node key, to the
//! coordinator of the fleet it talks to now.
use crate::identity::Identity;
pub use fleet_proto::dial::{DialError, Dialed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The fleet's coordinators as this node knows them, and the one it talks to now; shared by the
/// session (which moves on when its coordinator does not answer) and the content path (which
/// follows the session).
#[derive(Clone, Debug)]
pub struct Coordinators(Arc<Mutex<Known>>);

#[derive(Debug)]
struct Known {
    addresses: Vec<String>,
    current: usize,
}

impl Coordinators {
    /// `addresses`, the first one current; the others in an order of this node's own, so the
    /// nodes of a coordinator that goes away spread over the rest instead of all moving to the
    /// same next one. Never empty.
    pub fn new(mut addresses: Vec<String>) -> Coordinators {
        assert!(
            !addresses.is_empty(),
            "a node knows at least one coordinator"
        );
        rand::seq::SliceRandom::shuffle(&mut addresses[1..], &mut rand::thread_rng());
        Coordinators(Arc::new(Mutex::new(Known {
            addresses,
            current: 0,
        })))
    }

    pub fn current(&self) -> String {
        let known = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        known.addresses[known.current].clone()
    }

    /// Moves on to the next coordinator (the current one did not answer).
    pub fn advance(&self) {
        let mut known = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        known.current = (known.current + 1) % known.addresses.len();
    }

    /// Every coordinator known, the current one first.
    pub fn all(&self) -> Vec<String> {
        let known = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let n = known.addresses.len();
        (0..n)
            .map(|i| known.addresses[(known.current + i) % n].clone())
            .collect()
    }

    /// Adds the coordinators a session named that were not known yet; true when any was new.
    pub fn learn(&self, named: &[String]) -> bool {
        let mut known = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let before = known.addresses.len();
        for address in named {
            if !known.addresses.contains(address) {
                known.addresses.push(address.clone());
            }
        }
        known.addresses.len() > before
    }
}

/// Dials the coordinator at `address` as this node, accepting only the `pinned` key.
pub async fn dial(
    address: &str,
    identity: &Identity,
    pinned: &[u8],
    validity: Duration,
) -> Result<Dialed, DialError> {
    fleet_proto::dial::dial(address, &identity.key, pinned, validity).await
}
