//! Re-adoption and watching: compares every known, unfinished run with the runtime and spools one
//! event per transition, recording the new state in the same transaction as the event.
//!
//! Because the record and its event commit together, a crash at any point either spooled the
//! transition (and the next sync sees nothing new) or did not (and the next sync spools it): each
//! transition reaches the spool exactly once. The same function serves the agent's start
//! (re-adoption) and its periodic poll.
use super::{RunReport, RunState, Runtime, RuntimeError};
use crate::state::{Event, StateError, Store};
use fleet_proto::RunId;

/// What one sync did.
#[derive(Debug, Default)]
pub struct SyncReport {
    /// The events spooled by this sync, oldest first.
    pub events: Vec<Event>,
    /// Runs whose status could not be read this time; they are retried on the next sync.
    pub errors: Vec<RuntimeError>,
}

/// Brings the spool up to date with the runtime for every run not yet in a final state.
///
/// A run the runtime does not hold is `lost` once it was seen `running` (its folder is gone);
/// while still `starting` its launch is in flight, or is completed from its record when the
/// agent starts ([`crate::node::Node::unlaunched`]), so it is left alone here.
/// Blocking: call it from `tokio::task::spawn_blocking`.
pub fn sync_runs(store: &Store, runtime: &dyn Runtime) -> Result<SyncReport, StateError> {
    let mut report = SyncReport::default();
    // Only unfinished runs are asked about, so the cost follows the runs in flight, not the
    // thousand finished ones the run store keeps.
    for record in store.active_runs()? {
        sync_record(store, runtime, &record.run_id, record.state, &mut report)?;
    }
    Ok(report)
}

/// [`sync_runs`] for one run, right after its start, so `running` is reported without waiting
/// for the next watch. A run already final, or unknown to the store, is left alone.
pub fn sync_run(
    store: &Store,
    runtime: &dyn Runtime,
    run_id: &RunId,
) -> Result<SyncReport, StateError> {
    let mut report = SyncReport::default();
    if let Some(record) = store.run(run_id)?
        && !record.state.is_final()
    {
        sync_record(store, runtime, run_id, record.state, &mut report)?;
    }
    Ok(report)
}

fn sync_record(
    store: &Store,
    runtime: &dyn Runtime,
    run_id: &RunId,
    recorded: RunState,
    report: &mut SyncReport,
) -> Result<(), StateError> {
    let (state, run_report) = match runtime.status(run_id) {
        Ok(status) => (status.state, status.report),
        Err(RuntimeError::UnknownRun { .. }) if recorded == RunState::Starting => return Ok(()),
        Err(RuntimeError::UnknownRun { .. }) => (
            RunState::Lost,
            RunReport::error("the runtime no longer holds this run"),
        ),
        Err(e) => {
            report.errors.push(e);
            return Ok(());
        }
    };
    if let Some(event) = store.transition(run_id, state, run_report)? {
        report.events.push(event);
    }
    Ok(())
}
