//! The events a coordinator counts as they happen. Each part of the coordinator that sees one
//! records it here; the handles are shared counters and histograms, cheap to clone, and the
//! scrape registers the same handles each time.
use crate::census::FleetCounts;
use crate::store::RunMoved;
use fleet_proto::run::{Outcome, RunState};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

type Labels2 = [(&'static str, &'static str); 2];
type Histograms = Family<Labels2, Histogram, fn() -> Histogram>;

/// How long after a scrape the background loop keeps taking a census.
const CENSUS_WANTED_MS: u64 = 120_000;

/// Minutes of ended runs the status page draws.
const MINUTES_KEPT: usize = 60;

#[derive(Debug, Clone)]
pub(crate) struct Recorder {
    run_start: Histogram,
    runs_ended: Family<Labels2, Counter>,
    heartbeat_gap: Histogram,
    commit_seconds: Histograms,
    commit_batch: Histogram,
    cap_reached: Counter,
    connections: Gauge,
    relays: Counter,
    peer_copies: Counter,
    heartbeat_period: Gauge<f64, AtomicU64>,
    lease: Gauge<f64, AtomicU64>,
    /// Runs ended in each of the last minutes, for the status page: (minute since the epoch, count).
    ended_minutes: Arc<Mutex<VecDeque<(u64, u64)>>>,
    /// The fleet as the store said at the last census, and when (Unix ms).
    census: Arc<Mutex<Option<(u64, FleetCounts)>>>,
    /// When the census was last asked for by a scrape (Unix ms).
    census_asked_ms: Arc<AtomicU64>,
}

impl Default for Recorder {
    fn default() -> Recorder {
        Recorder {
            // 50 ms to about 27 min: a start on an idle fleet to one queued behind a long pull.
            run_start: Histogram::new(exponential_buckets(0.05, 2.0, 16)),
            runs_ended: Family::default(),
            // 0.5 s to about 2 min: a heartbeat on time (5 s by default) up to one past any lease.
            heartbeat_gap: Histogram::new(exponential_buckets(0.5, 2.0, 9)),
            // 0.5 ms to about 4 s: an fsync on a quiet disk to a database under a failover.
            commit_seconds: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.0005, 2.0, 14))
            }),
            // 1 to 512: the group commit's largest batch is 512 changes.
            commit_batch: Histogram::new(exponential_buckets(1.0, 2.0, 10)),
            cap_reached: Counter::default(),
            connections: Gauge::default(),
            relays: Counter::default(),
            peer_copies: Counter::default(),
            heartbeat_period: Gauge::default(),
            lease: Gauge::default(),
            ended_minutes: Arc::default(),
            census: Arc::default(),
            census_asked_ms: Arc::default(),
        }
    }
}

impl Recorder {
    /// What `serve` was told: the heartbeat it asks of agents and the lease it grants.
    pub(crate) fn serving_with(&self, heartbeat: Duration, lease: Duration) {
        self.heartbeat_period.set(heartbeat.as_secs_f64());
        self.lease.set(lease.as_secs_f64());
    }

    /// Runs that moved in one committed change.
    pub(crate) fn runs_moved(&self, moved: &[RunMoved]) {
        for m in moved {
            if m.state == RunState::Running {
                let waited = m.at_ms.saturating_sub(m.created_ms);
                self.run_start.observe(waited as f64 / 1000.0);
            }
            if m.state.is_final() {
                let how = how_it_ended(m.outcome.as_ref());
                let labels = [("state", m.state.as_str()), ("how", how)];
                self.runs_ended.get_or_create(&labels).inc();
                self.ended_at(m.at_ms);
            }
        }
    }

    /// Whether the background loop should take a census at `now_ms`: a scrape asked for one in
    /// the last two minutes (the sweeping coordinator reads the fleet anyway, and takes one then).
    pub(crate) fn census_wanted(&self, now_ms: u64) -> bool {
        let asked = self.census_asked_ms.load(Ordering::Relaxed);
        asked != 0 && now_ms.saturating_sub(asked) < CENSUS_WANTED_MS
    }

    /// The fleet as the store said at `taken_ms`.
    pub(crate) fn took_census(&self, taken_ms: u64, counts: FleetCounts) {
        *self.census.lock().unwrap_or_else(PoisonError::into_inner) = Some((taken_ms, counts));
    }

    /// The last census if it is at most two heartbeat periods old at `now_ms`; the scrape that
    /// asks keeps the next ones coming.
    pub(crate) fn census(&self, now_ms: u64) -> Option<FleetCounts> {
        self.census_asked_ms.store(now_ms, Ordering::Relaxed);
        let fresh_ms = (self.heartbeat_period.get() * 2000.0) as u64;
        let census = self.census.lock().unwrap_or_else(PoisonError::into_inner);
        (census.as_ref())
            .filter(|(taken, _)| now_ms.saturating_sub(*taken) <= fresh_ms)
            .map(|(_, counts)| counts.clone())
    }

    /// One run ended at `at_ms`, in its minute.
    fn ended_at(&self, at_ms: u64) {
        let minute = at_ms / 60_000;
        let mut minutes = self
            .ended_minutes
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match minutes.back_mut() {
            Some((m, n)) if *m == minute => *n += 1,
            Some((m, _)) if *m > minute => {}
            _ => minutes.push_back((minute, 1)),
        }
        while minutes.len() > MINUTES_KEPT {
            minutes.pop_front();
        }
    }

    /// The heartbeat period, in milliseconds.
    pub(crate) fn heartbeat_ms(&self) -> u64 {
        (self.heartbeat_period.get() * 1000.0) as u64
    }

    /// Runs ended in each of the last minutes up to `now_ms`'s, oldest first: what the status
    /// page draws.
    pub(crate) fn ended_per_minute(&self, now_ms: u64) -> Vec<u64> {
        let now = now_ms / 60_000;
        let minutes = self
            .ended_minutes
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        (0..MINUTES_KEPT as u64)
            .rev()
            .map(|ago| {
                let minute = now.saturating_sub(ago);
                (minutes.iter())
                    .find(|(m, _)| *m == minute)
                    .map_or(0, |(_, n)| *n)
            })
            .collect()
    }

    /// What a session's reader records each heartbeat into: one histogram, not every handle.
    pub(crate) fn heartbeat_gaps(&self) -> HeartbeatGaps {
        HeartbeatGaps(self.heartbeat_gap.clone())
    }

    /// One group commit of `changes` on `backend`.
    pub(crate) fn commit(&self, backend: &'static str, changes: usize, took: Duration) {
        let labels = [("backend", backend), ("writes", "changes")];
        self.commit_seconds
            .get_or_create(&labels)
            .observe(took.as_secs_f64());
        self.commit_batch.observe(changes as f64);
    }

    /// One write of the heartbeats heard in the last second, on `backend`.
    pub(crate) fn leases_written(&self, backend: &'static str, took: Duration) {
        let labels = [("backend", backend), ("writes", "leases")];
        self.commit_seconds
            .get_or_create(&labels)
            .observe(took.as_secs_f64());
    }

    pub(crate) fn cap_reached(&self) {
        self.cap_reached.inc();
    }

    /// A connection served from now until the guard is dropped.
    pub(crate) fn connection_open(&self) -> OpenConnection {
        self.connections.inc();
        OpenConnection(self.connections.clone())
    }

    pub(crate) fn relayed(&self) {
        self.relays.inc();
    }

    pub(crate) fn copied_from_peer(&self) {
        self.peer_copies.inc();
    }

    /// Registers every handle (clones sharing the same values) in `registry`.
    pub(crate) fn register(&self, registry: &mut Registry) {
        registry.register(
            "fleet_run_start_seconds",
            "Time from a run's creation to its node reporting it running",
            self.run_start.clone(),
        );
        registry.register(
            "fleet_runs_ended",
            "Runs that reached a final state through this coordinator, by state and by what ended them",
            self.runs_ended.clone(),
        );
        registry.register(
            "fleet_heartbeat_interval_seconds",
            "Time between two heartbeats of one session, as this coordinator heard them",
            self.heartbeat_gap.clone(),
        );
        registry.register(
            "fleet_store_commit_seconds",
            "Time one store transaction took, by backend, for the group commit (writes=changes) and the heartbeat writer (writes=leases)",
            self.commit_seconds.clone(),
        );
        registry.register(
            "fleet_store_commit_batch_size",
            "Changes applied in one group commit",
            self.commit_batch.clone(),
        );
        registry.register(
            "fleet_connection_cap_reached",
            "Times the connection cap was reached (new connections then wait in the listen backlog)",
            self.cap_reached.clone(),
        );
        registry.register(
            "fleet_connections_open",
            "Connections this coordinator serves now (sessions, joins and transfers)",
            self.connections.clone(),
        );
        registry.register(
            "fleet_heartbeat_period_seconds",
            "How often this coordinator asks agents for a heartbeat (serve --heartbeat)",
            self.heartbeat_period.clone(),
        );
        registry.register(
            "fleet_lease_seconds",
            "How long a node stays joined without a heartbeat (serve --lease)",
            self.lease.clone(),
        );
        registry.register(
            "fleet_relays",
            "Commands this coordinator relayed through the coordinator holding the node's session, answered",
            self.relays.clone(),
        );
        registry.register(
            "fleet_peer_copies",
            "Blobs copied from another coordinator of the fleet",
            self.peer_copies.clone(),
        );
    }
}

/// A final run's outcome in a few words: what ended it, never its exit code's value.
pub(crate) fn how_it_ended(outcome: Option<&Outcome>) -> &'static str {
    let Some(o) = outcome else {
        return "no_outcome";
    };
    if o.timed_out {
        "timed_out"
    } else if o.stopped {
        "stopped"
    } else if o.oom_killed == Some(true) {
        "oom_killed"
    } else if o.signal.is_some() {
        "signal"
    } else {
        match o.exit_code {
            Some(0) => "exit_zero",
            Some(_) => "exit_nonzero",
            None => "no_outcome",
        }
    }
}

/// The time between a session's heartbeats, as its reader hears them.
#[derive(Debug, Clone)]
pub(crate) struct HeartbeatGaps(Histogram);

impl HeartbeatGaps {
    pub(crate) fn heard_after(&self, gap: Duration) {
        self.0.observe(gap.as_secs_f64());
    }
}

/// Counts one open connection while it lives (one pointer in each connection's task).
#[derive(Debug)]
pub(crate) struct OpenConnection(Gauge);

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_outcome_is_named_by_what_ended_it() {
        let ended = |o: Outcome| how_it_ended(Some(&o));
        assert_eq!(how_it_ended(None), "no_outcome");
        assert_eq!(
            ended(Outcome {
                exit_code: Some(0),
                ..Outcome::default()
            }),
            "exit_zero"
        );
        assert_eq!(
            ended(Outcome {
                exit_code: Some(3),
                ..Outcome::default()
            }),
            "exit_nonzero"
        );
        let timed_out = Outcome {
            signal: Some(9),
            timed_out: true,
            ..Outcome::default()
        };
        assert_eq!(ended(timed_out), "timed_out", "the timeout, not its signal");
        assert_eq!(
            ended(Outcome {
                signal: Some(15),
                ..Outcome::default()
            }),
            "signal"
        );
        assert_eq!(
            ended(Outcome {
                oom_killed: Some(true),
                ..Outcome::default()
            }),
            "oom_killed"
        );
    }

    #[test]
    fn runs_ended_are_drawn_by_minute_and_a_start_is_timed_from_creation() {
        let recorder = Recorder::default();
        let moved = |state, created_ms, at_ms| RunMoved {
            state,
            outcome: None,
            created_ms,
            at_ms,
        };
        let minute = 60_000;
        recorder.runs_moved(&[
            moved(RunState::Running, 1_000, 3_500),
            moved(RunState::Lost, 0, 100 * minute),
            moved(RunState::Finished, 0, 100 * minute + 5),
            moved(RunState::Failed, 0, 102 * minute),
        ]);
        assert_eq!(
            (recorder.run_start.count(), recorder.run_start.sum()),
            (1, 2.5)
        );
        let drawn = recorder.ended_per_minute(102 * minute + 30_000);
        assert_eq!(drawn.len(), MINUTES_KEPT);
        assert_eq!(
            drawn[MINUTES_KEPT - 3..],
            [2, 0, 1],
            "two minutes ago, one, this one"
        );
    }

    #[test]
    fn a_census_older_than_two_heartbeats_is_not_used_and_asking_keeps_them_coming() {
        let recorder = Recorder::default();
        recorder.serving_with(Duration::from_secs(5), Duration::from_secs(20));
        assert!(!recorder.census_wanted(1_000), "nobody scraped yet");
        assert!(recorder.census(1_000).is_none(), "none taken yet");
        assert!(recorder.census_wanted(2_000), "a scrape asked for one");
        recorder.took_census(2_000, FleetCounts::default());
        assert!(recorder.census(12_000).is_some(), "two heartbeats old");
        assert!(recorder.census(12_001).is_none(), "older");
        assert!(
            !recorder.census_wanted(12_001 + CENSUS_WANTED_MS),
            "scrapes stopped"
        );
    }
}
