//! The agent's one way out: the pinned dial of `fleet_proto::dial` with the node key, to the
//! coordinator of the fleet it talks to now.
use crate::backoff::Backoff;
use crate::identity::Identity;
pub use fleet_proto::dial::{DialError, Dialed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long going home may take (the connection and home's welcome) before the node stays where
/// it is, to look again later: its session elsewhere goes on meanwhile, so waiting costs nothing,
/// while giving up costs home the session it was opening, opened again at the next try (at 30 s,
/// thousands of nodes did so over and over in a 30 000-node rolling restart, BENCHMARKS.md).
const HOME_DIAL_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a node whose coordinator said it stops (a shutdown, most often a restart) keeps
/// dialing that one before it moves on: a restart's nodes come back to it instead of crowding
/// the others and coming home later.
pub const RESTART_WINDOW: Duration = Duration::from_secs(10);
/// The longest a node waits before its first dial back to a coordinator that said it stops: its
/// nodes come back spread over a quarter of their lease, up to this, instead of all at once (ten
/// thousand handshakes in one second time out and come back later still, BENCHMARKS.md).
const RETURN_SPREAD_CAP: Duration = Duration::from_millis(7_500);

/// What [`Coordinators::advance`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Advanced {
    /// The current coordinator said it stops within [`RESTART_WINDOW`]: it is dialed again;
    /// the window ends `left` from now. The first dial since the word waits a random part of
    /// `spread`, the rest the backoff.
    Stayed {
        left: Duration,
        spread: Option<Duration>,
    },
    /// On to the next coordinator.
    Moved,
    /// On to the next coordinator, the stopped one's window having ended without it back: the
    /// next one has not failed, so it is dialed without the backoff grown on the stopped one.
    AfterWindow,
}

/// The fleet's coordinators as this node knows them, and the one it talks to now; shared by the
/// session (which moves on when its coordinator does not answer) and the content path (which
/// follows the session).
#[derive(Clone, Debug)]
pub struct Coordinators(Arc<Mutex<Known>>);

#[derive(Debug)]
struct Known {
    addresses: Vec<String>,
    current: usize,
    /// Until when the current coordinator is dialed again after it said it stops.
    stay_until: Option<std::time::Instant>,
    /// Whether the next dial is the first since a coordinator said it stops.
    first_since_stop: bool,
    /// The lease of the last welcome, which sets how widely a stop's nodes spread their return.
    lease: Option<Duration>,
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
            stay_until: None,
            first_since_stop: false,
            lease: None,
        })))
    }

    pub fn current(&self) -> String {
        let known = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        known.addresses[known.current].clone()
    }

    /// Moves on to the next coordinator (the current one did not answer), unless the current
    /// one said it stops less than [`RESTART_WINDOW`] ago: it may be restarting.
    fn advance(&self) -> Advanced {
        self.advance_at(std::time::Instant::now())
    }

    /// [`Coordinators::advance`], answering how long to wait before the next dial: the
    /// backoff's next wait, no later than the end of a restart window, and from the start again
    /// once the window ended.
    pub fn advance_after(&self, backoff: &mut Backoff) -> Duration {
        match self.advance() {
            Advanced::Stayed {
                left,
                spread: Some(spread),
            } => rand::Rng::gen_range(&mut rand::thread_rng(), Duration::ZERO..=spread).min(left),
            Advanced::Stayed { left, spread: None } => backoff.next_delay().min(left),
            Advanced::Moved => backoff.next_delay(),
            Advanced::AfterWindow => {
                backoff.reset();
                backoff.next_delay()
            }
        }
    }

    fn advance_at(&self, now: std::time::Instant) -> Advanced {
        let mut known = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(until) = known.stay_until.filter(|until| now < *until) {
            let first = std::mem::take(&mut known.first_since_stop);
            let spread = known.lease.map(|lease| (lease / 4).min(RETURN_SPREAD_CAP));
            return Advanced::Stayed {
                left: until - now,
                spread: spread.filter(|_| first),
            };
        }
        let window = known.stay_until.take();
        known.current = (known.current + 1) % known.addresses.len();
        match window {
            Some(_) => Advanced::AfterWindow,
            None => Advanced::Moved,
        }
    }

    /// The current coordinator said it stops: it is dialed again, not the next one, for
    /// [`RESTART_WINDOW`] from now (or from the word that began a window still open, so one that
    /// keeps stopping sessions is left once that window ends).
    pub fn stopping(&self) {
        self.stopping_at(std::time::Instant::now());
    }

    fn stopping_at(&self, now: std::time::Instant) {
        let mut known = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if known.stay_until.is_none_or(|until| until <= now) {
            known.stay_until = Some(now + RESTART_WINDOW);
            known.first_since_stop = true;
        }
    }

    /// A coordinator welcomed this node with `lease`.
    pub fn welcomed(&self, lease: Duration) {
        let mut known = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        known.lease = Some(lease);
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

    /// The coordinator this node joined through (its home), while its session is elsewhere.
    pub fn away_from_home(&self) -> Option<String> {
        let known = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        (known.current != 0).then(|| known.addresses[0].clone())
    }

    /// Makes the home coordinator the current one again.
    pub fn go_home(&self) {
        let mut known = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        known.current = 0;
    }

    /// Resolves with what `dial` made of home (a connection home has welcomed the node on) once a
    /// session away from home should go back. Tried every 15 to 45 s, at random, so the nodes a
    /// restarted coordinator held return to it spread over time instead of piling up on the others
    /// restart after restart; the session it leaves ends only once home has welcomed the node (a
    /// home still too busy to shake hands or to open the session costs the node nothing, and the
    /// node is never without a session on the way).
    pub async fn dial_home<T, E, Fut>(&self, dial: impl Fn(String) -> Fut) -> T
    where
        Fut: std::future::Future<Output = Result<T, E>>,
    {
        loop {
            let delay = 15_000 + rand::random::<u64>() % 30_000;
            tokio::time::sleep(Duration::from_millis(delay)).await;
            let Some(home) = self.away_from_home() else {
                continue;
            };
            if let Ok(Ok(dialed)) = tokio::time::timeout(HOME_DIAL_TIMEOUT, dial(home)).await {
                return dialed;
            }
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn three() -> Coordinators {
        Coordinators::new(vec!["a:1".into(), "b:1".into(), "c:1".into()])
    }

    #[test]
    fn a_failed_coordinator_is_left_at_once() {
        let known = three();
        known.advance();
        assert_ne!(known.current(), "a:1");
    }

    #[test]
    fn a_stopping_coordinator_is_dialed_again_for_the_restart_window_then_left() {
        let known = three();
        let t0 = Instant::now();
        known.stopping_at(t0);
        assert_eq!(
            known.advance_at(t0 + Duration::from_millis(200)),
            Advanced::Stayed {
                left: RESTART_WINDOW - Duration::from_millis(200),
                spread: None,
            },
            "no welcome told a lease: no spread"
        );
        known.advance_at(t0 + RESTART_WINDOW - Duration::from_millis(1));
        assert_eq!(known.current(), "a:1", "still within the window");
        assert_eq!(known.advance_at(t0 + RESTART_WINDOW), Advanced::AfterWindow);
        assert_ne!(known.current(), "a:1", "the window is over");
        assert_eq!(
            known.advance_at(t0 + RESTART_WINDOW * 2),
            Advanced::Moved,
            "only the move that ends a window says so"
        );
    }

    #[test]
    fn the_first_dial_back_after_a_stop_is_spread_over_a_quarter_lease_capped() {
        let known = three();
        let t0 = Instant::now();
        known.welcomed(Duration::from_secs(8));
        known.stopping_at(t0);
        let stayed = |spread| Advanced::Stayed {
            left: RESTART_WINDOW - Duration::from_secs(1),
            spread,
        };
        let later = t0 + Duration::from_secs(1);
        assert_eq!(
            known.advance_at(later),
            stayed(Some(Duration::from_secs(2)))
        );
        assert_eq!(known.advance_at(later), stayed(None), "then the backoff");
        let t1 = t0 + RESTART_WINDOW * 3;
        known.welcomed(Duration::from_secs(300));
        known.stopping_at(t1);
        assert_eq!(
            known.advance_at(t1),
            Advanced::Stayed {
                left: RESTART_WINDOW,
                spread: Some(RETURN_SPREAD_CAP)
            }
        );
        let mut backoff = Backoff::new(Duration::from_millis(100));
        known.stopping_at(t1 + RESTART_WINDOW * 2);
        assert!(known.advance_after(&mut backoff) <= RETURN_SPREAD_CAP);
        for _ in 0..5 {
            assert!(known.advance_after(&mut backoff) <= Duration::from_secs(4));
        }
    }

    #[test]
    fn a_coordinator_that_keeps_stopping_sessions_is_left_when_the_first_window_ends() {
        let known = three();
        let t0 = Instant::now();
        known.stopping_at(t0);
        // Welcomed again and stopped again, within the window: the window does not grow.
        known.stopping_at(t0 + Duration::from_secs(5));
        known.advance_at(t0 + RESTART_WINDOW);
        assert_ne!(known.current(), "a:1");
        // The next one stopping, later, begins a window of its own.
        let next = known.current();
        let t1 = t0 + RESTART_WINDOW * 3;
        known.stopping_at(t1);
        known.advance_at(t1 + Duration::from_secs(1));
        assert_eq!(known.current(), next);
    }
}
