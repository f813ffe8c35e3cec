//! Failed joins by source address: each source may fail a burst of joins, then one a second; a
//! source past that has its new connections closed at accept, before any TLS work, until its
//! allowance refills. What a flood of wrong tokens costs the coordinator is then an accept and
//! a close, and sessions already held are untouched.
//!
//! A source whose allowance is short of whole pays for each new connection at accept, before
//! its join is read, and is paid back once the connection proves to be anything but a failed
//! join (a connection that never says what it is keeps what it paid): however many connections
//! it opens at once, no more are served than its allowance holds.
use super::guarded::Guarded;
use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// Failed joins a source may make at once.
pub const BURST: f64 = 10.0;
/// Then this many a second.
pub const REFILL_PER_SECOND: f64 = 1.0;
/// Sources remembered at most; past it the fullest allowances are forgotten first.
const MAX_SOURCES: usize = 65_536;
/// A refused source's line is logged at most this often.
const LOG_EVERY: Duration = Duration::from_secs(10);

#[derive(Default)]
pub(crate) struct JoinLimits {
    state: Guarded<HashMap<IpAddr, Allowance>>,
}

struct Allowance {
    tokens: f64,
    at: Instant,
    /// Connections refused since the last line about this source.
    refused: u64,
    logged_at: Option<Instant>,
}

impl Allowance {
    fn refill(&mut self, now: Instant) {
        let gained = now.saturating_duration_since(self.at).as_secs_f64() * REFILL_PER_SECOND;
        self.tokens = (self.tokens + gained).min(BURST);
        self.at = now;
    }
}

/// What [`JoinLimits::admit`] decided for one new connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Admission {
    /// Closed at accept: the source is past its allowance.
    Refused,
    /// Served, and the source owes nothing: its allowance is whole (it failed no join lately).
    Free,
    /// Served, charged one failed join in advance: the source's allowance is short of whole.
    Charged,
}

impl JoinLimits {
    /// Whether a new connection from `source` is served: refused while the source is past its
    /// allowance of failed joins (one line in the log for it every 10 s at most); charged one
    /// failed join at once while its allowance is short of whole.
    pub(crate) fn admit(&self, source: IpAddr) -> Admission {
        self.admit_at(source, Instant::now())
    }

    fn admit_at(&self, source: IpAddr, now: Instant) -> Admission {
        let mut sources = self.state.lock();
        let Some(allowance) = sources.get_mut(&source) else {
            return Admission::Free;
        };
        allowance.refill(now);
        if allowance.tokens >= BURST {
            return Admission::Free;
        }
        if allowance.tokens >= 1.0 {
            allowance.tokens -= 1.0;
            return Admission::Charged;
        }
        allowance.refused += 1;
        if allowance
            .logged_at
            .is_none_or(|at| now.duration_since(at) >= LOG_EVERY)
        {
            tracing::warn!(
                %source,
                refused = allowance.refused,
                "refusing connections from {source}: it sent more than {BURST} joins with wrong tokens; it may try again at {REFILL_PER_SECOND} a second ({} refused since the last line)",
                allowance.refused
            );
            allowance.refused = 0;
            allowance.logged_at = Some(now);
        }
        Admission::Refused
    }

    /// A join from `source` that was refused (an unknown, expired or spent token), on a
    /// connection admitted as `admitted`.
    pub(crate) fn failed(&self, source: IpAddr, admitted: Admission) {
        if admitted != Admission::Charged {
            self.failed_at(source, Instant::now());
        }
    }

    /// A connection admitted as `admitted` proved to be something other than a failed join (a
    /// join that was answered, a session, a transfer, a download): what it was charged is paid
    /// back.
    pub(crate) fn not_failed(&self, source: IpAddr, admitted: Admission) {
        if admitted == Admission::Charged
            && let Some(allowance) = self.state.lock().get_mut(&source)
        {
            allowance.tokens = (allowance.tokens + 1.0).min(BURST);
        }
    }

    fn failed_at(&self, source: IpAddr, now: Instant) {
        let mut sources = self.state.lock();
        if sources.len() >= MAX_SOURCES && !sources.contains_key(&source) {
            // Forget the sources that have their whole allowance back: they are no one's concern.
            sources.retain(|_, a| {
                a.refill(now);
                a.tokens < BURST
            });
        }
        if sources.len() >= MAX_SOURCES && !sources.contains_key(&source) {
            return;
        }
        let allowance = sources.entry(source).or_insert(Allowance {
            tokens: BURST,
            at: now,
            refused: 0,
            logged_at: None,
        });
        allowance.refill(now);
        allowance.tokens = (allowance.tokens - 1.0).max(0.0);
    }

    /// Sources with an allowance short of whole.
    #[cfg(test)]
    fn tracked(&self) -> usize {
        self.state.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([127, 0, 0, last])
    }

    #[test]
    fn a_source_past_its_burst_is_refused_until_its_allowance_refills() {
        let limits = JoinLimits::default();
        let t0 = Instant::now();
        for _ in 0..BURST as usize {
            let admitted = limits.admit_at(ip(2), t0);
            assert_ne!(admitted, Admission::Refused);
            limits.failed(ip(2), admitted);
        }
        assert_eq!(
            limits.admit_at(ip(2), t0),
            Admission::Refused,
            "the burst is spent"
        );
        assert_eq!(
            limits.admit_at(ip(3), t0),
            Admission::Free,
            "another source is not touched"
        );
        let later = t0 + Duration::from_secs_f64(1.0 / REFILL_PER_SECOND);
        let admitted = limits.admit_at(ip(2), later);
        assert_eq!(admitted, Admission::Charged, "one more a second");
        limits.failed(ip(2), admitted);
        assert_eq!(limits.admit_at(ip(2), later), Admission::Refused);
        let whole = later + Duration::from_secs(60);
        assert_eq!(
            limits.admit_at(ip(2), whole),
            Admission::Free,
            "whole again"
        );
    }

    #[test]
    fn connections_opened_at_once_by_a_source_that_failed_are_served_no_more_than_its_allowance() {
        let limits = JoinLimits::default();
        let t0 = Instant::now();
        limits.failed(ip(2), limits.admit_at(ip(2), t0));
        // Many at once, none answered yet: each is paid for at accept.
        let served: Vec<Admission> = (0..100)
            .map(|_| limits.admit_at(ip(2), t0))
            .filter(|a| *a != Admission::Refused)
            .collect();
        assert_eq!(served.len(), BURST as usize - 1);
        // One proves to be a session: what it paid comes back, and one more is served.
        limits.not_failed(ip(2), served[0]);
        assert_eq!(limits.admit_at(ip(2), t0), Admission::Charged);
        assert_eq!(limits.admit_at(ip(2), t0), Admission::Refused);
        // The rest fail: already paid, not charged twice.
        for admitted in &served[1..] {
            limits.failed(ip(2), *admitted);
        }
        let later = t0 + Duration::from_secs_f64(1.0 / REFILL_PER_SECOND);
        assert_eq!(limits.admit_at(ip(2), later), Admission::Charged);
    }

    #[test]
    fn memory_stays_bounded_however_many_sources_fail() {
        let limits = JoinLimits::default();
        let t0 = Instant::now();
        for n in 0..(MAX_SOURCES as u32 + 1000) {
            limits.failed_at(IpAddr::from(n.to_be_bytes()), t0);
        }
        assert!(limits.tracked() <= MAX_SOURCES);
        // Once their allowances are whole again, room is made for new sources.
        let later = t0 + Duration::from_secs(3600);
        limits.failed_at(ip(9), later);
        assert!(limits.tracked() < MAX_SOURCES);
        limits.failed_at(ip(9), later);
        assert_ne!(limits.admit_at(ip(9), later), Admission::Refused);
    }
}
