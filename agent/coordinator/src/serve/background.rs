//! The serving coordinator's loops beside its connections: heartbeat writes, the sweep (with the
//! fleet's membership and the blob sweep), the fallback wake-up of sessions with runs waiting,
//! and the listener for runs created through another coordinator. [`Background`] stops them all.
use super::ServeConfig;
use crate::census::FleetCounts;
use crate::store::Beat;
use crate::{Coordinator, CoordinatorError};
use fleet_cli::blocking::off_thread;
use fleet_proto::NodeId;
use fleet_proto::clock::now_ms;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Heartbeats are written together this often at most (at least once per heartbeat interval):
/// one commit a second, whatever the fleet's size.
const BEAT_WRITES: Duration = Duration::from_secs(1);

/// The loops while serving; dropped, they stop.
pub(super) struct Background {
    tasks: Vec<tokio::task::JoinHandle<()>>,
    listening: Arc<AtomicBool>,
}

impl Drop for Background {
    fn drop(&mut self) {
        self.listening.store(false, Ordering::SeqCst);
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Starts the loops.
pub(super) fn start(coordinator: &Arc<Coordinator>, config: &Arc<ServeConfig>) -> Background {
    let tasks = vec![
        tokio::spawn(sweep_forever(coordinator.clone(), config.clone())),
        tokio::spawn(wake_waiting_forever(coordinator.clone(), config.heartbeat)),
        tokio::spawn(follow_node_changes_forever(coordinator.clone())),
        tokio::spawn(keep_copies_forever(coordinator.clone(), config.lease)),
        tokio::spawn(drive_rollout_forever(coordinator.clone())),
    ];
    let listening = Arc::new(AtomicBool::new(true));
    listen_for_waiting(coordinator.clone(), listening.clone());
    let period = BEAT_WRITES.min(config.heartbeat);
    write_beats_forever(coordinator.clone(), period, config.lease, listening.clone());
    Background { tasks, listening }
}

/// Writes the heartbeats gathered since the last write, in one change (one commit), every
/// `period`, on a thread of its own: the async thread may lag seconds behind 10 000 returning
/// sessions' handshakes, and a lease must not wait for it. A round that comes late, or heartbeats
/// left unwritten for long, is logged: leases then run out unseen.
fn write_beats_forever(
    coordinator: Arc<Coordinator>,
    period: Duration,
    lease: Duration,
    serving: Arc<AtomicBool>,
) {
    let late_after = lease / 6;
    let write = move || {
        let mut last_round = std::time::Instant::now();
        while serving.load(Ordering::SeqCst) {
            std::thread::sleep(period.saturating_sub(last_round.elapsed()));
            let beats: Vec<Beat> = coordinator.beats().take();
            let gap = last_round.elapsed();
            last_round = std::time::Instant::now();
            if beats.is_empty() {
                continue;
            }
            let count = beats.len();
            let written = coordinator.store().write_leases(&beats);
            let took = last_round.elapsed();
            coordinator
                .recorder()
                .leases_written(coordinator.store().kind(), took);
            if gap + took > late_after {
                tracing::warn!(
                    beats = count,
                    gap_ms = gap.as_millis() as u64,
                    write_ms = took.as_millis() as u64,
                    lease_ms = lease.as_millis() as u64,
                    "heartbeats were written late: the store is slow or short of CPU, and leases may run out while nodes are in session"
                );
            }
            match written {
                // Nodes whose lease a commit held at that moment: written with the next ones.
                Ok(left) => {
                    let now = now_ms();
                    let stale = (left.iter())
                        .filter(|b| {
                            now.saturating_sub(b.at_ms.unwrap_or(now))
                                > late_after.as_millis() as u64
                        })
                        .count();
                    if stale > 0 {
                        tracing::warn!(
                            beats = stale,
                            "heartbeats heard over {} s ago are still unwritten: their leases stay held by other transactions",
                            late_after.as_secs()
                        );
                    }
                    coordinator.beats().restore(left)
                }
                Err(e) => {
                    tracing::warn!(
                        "writing heartbeats failed (tried again with the next ones): {e}"
                    );
                    coordinator.beats().restore(beats);
                }
            }
        }
    };
    let spawned = std::thread::Builder::new()
        .name("lease-writes".into())
        .spawn(write);
    if let Err(e) = spawned {
        tracing::error!("cannot start the thread that writes heartbeats: {e}; leases will run out");
    }
}

/// Runs created through another coordinator of the same database wake the sessions held here
/// at once: that coordinator's commit notifies (PostgreSQL's NOTIFY), this thread hears it.
/// A store only this coordinator opens has nobody to hear from, and the thread ends at once.
fn listen_for_waiting(coordinator: Arc<Coordinator>, serving: Arc<AtomicBool>) {
    let listen = move || {
        while serving.load(Ordering::SeqCst) {
            match coordinator.store().wait_for_waiting(Duration::from_secs(1)) {
                None => return,
                Some(Ok(true)) => coordinator.wake_waiting_sessions(),
                Some(Ok(false)) => {}
                Some(Err(e)) => {
                    tracing::warn!("listening for runs from the other coordinators failed: {e}");
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
        }
    };
    let spawned = std::thread::Builder::new()
        .name("listen-waiting".into())
        .spawn(listen);
    if let Err(e) = spawned {
        tracing::warn!("cannot listen for runs from the other coordinators: {e}");
    }
}

/// The fallback for a wake-up that did not come (a notice lost while the database restarted):
/// every `period`, the sessions held here whose node has runs waiting look at them.
async fn wake_waiting_forever(coordinator: Arc<Coordinator>, period: Duration) {
    let mut tick = tokio::time::interval(period);
    loop {
        tick.tick().await;
        let waker = coordinator.clone();
        if let Err(e) = tokio::task::spawn_blocking(move || waker.wake_waiting_sessions()).await {
            tracing::warn!("waking the sessions with runs waiting did not complete: {e}");
        }
    }
}

/// How often a coordinator looks whether the operator ended a node or set its capacity through
/// any coordinator: a revoked node's session is cut within a second wherever it is held.
const NODE_CHANGES_LOOK: Duration = Duration::from_millis(400);

/// The node changes seen at the last look: the store's count, and each node's capacity.
type SeenChanges = (u64, HashMap<NodeId, Option<u32>>);

/// Cuts the sessions held here of nodes the operator ended, and has those whose capacity changed
/// look at their runs again, whichever coordinator of the fleet the operator went through: one
/// read of a counter each look, and the nodes read only when it changed.
async fn follow_node_changes_forever(coordinator: Arc<Coordinator>) {
    let mut tick = tokio::time::interval(NODE_CHANGES_LOOK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seen: Option<SeenChanges> = None;
    loop {
        tick.tick().await;
        let (looker, before) = (coordinator.clone(), seen.take());
        let looked = tokio::task::spawn_blocking(move || {
            let changes = looker.store().node_changes()?;
            let before = match before {
                Some((count, capacities)) if count == changes => return Ok((count, capacities)),
                before => before.map(|(_, capacities)| capacities),
            };
            let mut capacities = HashMap::new();
            for node in looker.store().nodes()? {
                if let Some(ending) = node.ended {
                    looker.sessions().end(&node.id, ending.end);
                    continue;
                }
                let capacity = node.capacity();
                if before
                    .as_ref()
                    .is_some_and(|b| b.get(&node.id) != Some(&capacity))
                {
                    looker.sessions().capacity_changed(&node.id);
                }
                capacities.insert(node.id, capacity);
            }
            Ok::<_, CoordinatorError>((changes, capacities))
        })
        .await;
        match looked {
            Ok(Ok(looked)) => seen = Some(looked),
            Ok(Err(e)) => tracing::warn!("looking for nodes ended elsewhere failed: {e}"),
            Err(e) => tracing::warn!("looking for nodes ended elsewhere did not complete: {e}"),
        }
    }
}

/// Every lease, on the coordinator that sweeps: the content stored runs refer to is held by
/// `--content-copies` coordinators again (this one, copying it from any holder, and as many of
/// the others as it takes), so a holder gone for good costs a copy only until the next pass.
async fn keep_copies_forever(coordinator: Arc<Coordinator>, period: Duration) {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if !coordinator.fleet().sweeps() || coordinator.fleet().content_copies() < 2 {
            continue;
        }
        let referenced = coordinator
            .with_store(|store| store.referenced_content())
            .await;
        let digests = match referenced {
            Ok(digests) => digests,
            Err(e) => {
                tracing::warn!("reading the content runs refer to failed: {e}");
                continue;
            }
        };
        for digest in digests {
            let kept = match coordinator.ensure_blob(&digest).await {
                Ok(()) => coordinator.hold_copies(&digest).await,
                Err(e) => Err(e),
            };
            if let Err(e) = kept {
                tracing::warn!(%digest, "keeping the content's copies failed: {e}");
            }
        }
    }
}

/// Says in the store that this coordinator serves it, and learns which others do (those heard
/// within a lease).
pub(super) fn join_fleet(
    coordinator: &Coordinator,
    lease: Duration,
) -> Result<(), CoordinatorError> {
    if let Some(address) = coordinator.fleet().address() {
        coordinator.store().heard_coordinator(address, now_ms())?;
    }
    coordinator.learn_fleet(lease)
}

/// Every heartbeat: fail runs nobody took in time, mark runs of silent nodes `lost`, and let go
/// of registry credentials no run can use any more.
async fn sweep_forever(coordinator: Arc<Coordinator>, config: Arc<ServeConfig>) {
    let up_since = now_ms();
    let mut tick = tokio::time::interval(config.heartbeat);
    loop {
        tick.tick().await;
        let (swept_by, config) = (coordinator.clone(), config.clone());
        // The sweep is store calls only: off the async thread, like every other store call here.
        let swept = tokio::task::spawn_blocking(move || {
            if let Err(e) = join_fleet(&swept_by, config.lease) {
                tracing::warn!("saying this coordinator serves the store failed: {e}");
            }
            if let Err(e) = swept_by.sweep_blobs(crate::content::BLOB_GRACE) {
                tracing::warn!("the blob sweep failed: {e}");
            }
            // Whichever coordinator failed a waiting run, its credential here is let go.
            swept_by.credentials().expire();
            // One coordinator of a fleet sweeps the runs (the first by address of those heard
            // within a lease); when it goes away, the next one takes over. One read of the nodes
            // and the runs out serves the sweep and, while scrapes come, the metrics' census.
            let (now, sweeps) = (now_ms(), swept_by.fleet().sweeps());
            let census_wanted = swept_by.recorder().census_wanted(now);
            if !sweeps && !census_wanted {
                return Ok(());
            }
            let store = swept_by.store();
            // The whole records (and every token) only when a scrape will show the census.
            let (leases, active) = match census_wanted {
                true => {
                    let (nodes, active) = (store.nodes()?, store.active_runs()?);
                    let failed = store.failed_bootstraps()?.len();
                    let census = FleetCounts::of(&nodes, failed, &active, now);
                    swept_by.recorder().took_census(now, census);
                    let leases = nodes.into_iter().map(|n| (n.id, n.lease_until_ms));
                    (leases.collect::<Vec<_>>(), active)
                }
                false => (store.lease_ends()?, store.active_runs()?),
            };
            if !sweeps {
                return Ok(());
            }
            // The sweeping coordinator keeps the planner's view of the growing tables fresh.
            match store.refresh_statistics() {
                Ok(tables) if !tables.is_empty() => {
                    tracing::debug!(?tables, "tables measured again")
                }
                Ok(_) => {}
                Err(e) => tracing::warn!("cannot measure the grown tables again: {e}"),
            }
            swept_by.sweep(
                &leases,
                active,
                config.waiting_timeout.as_millis() as u64,
                up_since,
                config.lease.as_millis() as u64,
                now,
            )
        })
        .await;
        match swept {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!("the run sweep failed: {e}"),
            Err(e) => tracing::warn!("the run sweep did not complete: {e}"),
        }
    }
}

/// The rollout controller: a step a second while a rollout runs. Once it is done, only machines
/// that came later need the release: it steps when a session opened here since its last step,
/// and every [`DONE_ROLLOUT_LOOK`] for those a drain's end made ready, not reading the fleet
/// every second for nothing.
async fn drive_rollout_forever(coordinator: Arc<Coordinator>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut done_step: Option<(u64, tokio::time::Instant)> = None;
    loop {
        tick.tick().await;
        let opened = coordinator.sessions().opened();
        let done_too =
            done_step.is_none_or(|(seen, at)| seen != opened || at.elapsed() >= DONE_ROLLOUT_LOOK);
        if done_too {
            done_step = Some((opened, tokio::time::Instant::now()));
        }
        let stepping = coordinator.clone();
        let stepped = off_thread(move || stepping.step_rollout(done_too)).await;
        let sent = match stepped {
            Ok(Some((offer, nodes))) if !nodes.is_empty() => {
                coordinator.send_rollout(offer, nodes).await
            }
            Ok(_) => Ok(()),
            Err(e) => Err(e),
        };
        if let Err(e) = sent {
            done_step = None;
            tracing::warn!("the rollout step failed (tried again in a second): {e}");
        }
    }
}

/// How often a done rollout looks at the whole fleet when no session opened here meanwhile.
const DONE_ROLLOUT_LOOK: Duration = Duration::from_secs(30);
