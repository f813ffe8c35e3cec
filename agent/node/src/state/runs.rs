//! Run records: the runs this node knows and the last state it spooled for each, so every
//! transition is spooled exactly once, across restarts.
use super::{Event, StateError, Store, now_unix_ms};
use fleet_proto::protocol::StartRun;
use fleet_proto::run::{RunReport, RunState, Workload};
use fleet_proto::{Digest, RunId};
use redb::{ReadableTable, TableDefinition, WriteTransaction};

/// run id -> JSON [`RunRecord`].
const RUNS: TableDefinition<&str, &[u8]> = TableDefinition::new("runs");
/// Order in which runs reached a final state, so the oldest final records are pruned first.
const FINAL_ORDER: TableDefinition<u64, &str> = TableDefinition::new("final_order");
const META_FINAL_SEQ: &str = "final_seq";

/// How many final run records are kept, matching the run store's retention.
pub const KEEP_FINAL_RUNS: u64 = 1_000;

/// What the node knows about one run.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RunRecord {
    pub run_id: RunId,
    /// What the run executes.
    pub workload: Workload,
    /// The last state spooled for this run.
    pub state: RunState,
    /// When `state` was recorded, in milliseconds since the Unix epoch.
    pub updated_unix_ms: u64,
    /// The content its inputs were copied from (kept while this record is).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub inputs: Vec<Digest>,
    /// The start to complete if the agent stopped between this record and the runtime's launch;
    /// dropped once the run moves on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub launch: Option<Launch>,
}

/// A start as the node recorded it before launching: what completes the start when a crash cut
/// it off between the record and the runtime's claim.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Launch {
    /// The operation that started the run (the one its run id belongs to).
    pub op: String,
    /// The start without its registry credential: the node never records one.
    pub start: StartRun,
    /// Whether the start carried a registry credential, which a completed start would lack.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub had_registry_auth: bool,
}

impl Launch {
    /// The record of `start` under `op`, its registry credential left out.
    pub fn of(op: &str, start: &StartRun) -> Launch {
        Launch {
            op: op.to_string(),
            start: StartRun {
                registry_auth: None,
                ..start.clone()
            },
            had_registry_auth: start.registry_auth.is_some(),
        }
    }
}

impl RunRecord {
    /// The node's content this run refers to: its program and its inputs.
    pub fn content(&self) -> impl Iterator<Item = &Digest> {
        let program = match &self.workload {
            Workload::Program(digest) => Some(digest),
            Workload::Image(_) => None,
        };
        program.into_iter().chain(&self.inputs)
    }
}

impl Store {
    /// Starts tracking a run in state `starting` and spools that event, both in one transaction;
    /// call it before launching the run so a crash right after the launch still finds the record.
    ///
    /// Returns `None` when the run was already known (a redelivered start): nothing is spooled twice.
    /// Telling a redelivery from a second command reusing the id is the caller's job (by operation id).
    pub fn track_run(
        &self,
        run_id: &RunId,
        workload: &Workload,
    ) -> Result<Option<Event>, StateError> {
        self.track_run_with(run_id, workload, &[])
    }

    /// Like [`Store::track_run`], noting the content the run's inputs come from.
    pub fn track_run_with(
        &self,
        run_id: &RunId,
        workload: &Workload,
        inputs: &[Digest],
    ) -> Result<Option<Event>, StateError> {
        self.track(run_id, workload, inputs, None)
    }

    /// Like [`Store::track_run_with`] for the run `launch` starts, keeping the start itself so a
    /// crash before the launch is completed at the next open ([`crate::node::Node::unlaunched`]).
    pub fn track_launch(
        &self,
        launch: &Launch,
        inputs: &[Digest],
    ) -> Result<Option<Event>, StateError> {
        let start = &launch.start;
        self.track(&start.run_id, &start.workload, inputs, Some(launch))
    }

    fn track(
        &self,
        run_id: &RunId,
        workload: &Workload,
        inputs: &[Digest],
        launch: Option<&Launch>,
    ) -> Result<Option<Event>, StateError> {
        self.write(|tx| {
            if self.get_run(tx, run_id)?.is_some() {
                return Ok(None);
            }
            let record = RunRecord {
                run_id: run_id.clone(),
                workload: workload.clone(),
                state: RunState::Starting,
                updated_unix_ms: now_unix_ms(),
                inputs: inputs.to_vec(),
                launch: launch.cloned(),
            };
            self.put_run(tx, &record)?;
            self.append_in(tx, run_id, RunState::Starting, RunReport::default())
                .map(Some)
        })
    }

    /// Moves a known run to `state` and spools the event, in one transaction.
    ///
    /// Only forward moves count (`starting` -> `running` -> a final state); a repeated, backward or
    /// post-final observation changes nothing and returns `None`, so each transition is spooled once.
    pub fn transition(
        &self,
        run_id: &RunId,
        state: RunState,
        report: RunReport,
    ) -> Result<Option<Event>, StateError> {
        self.write(|tx| {
            let Some(mut record) = self.get_run(tx, run_id)? else {
                return Err(StateError::UnknownRun {
                    run_id: run_id.clone(),
                });
            };
            if !record.state.may_become(state) {
                return Ok(None);
            }
            record.state = state;
            record.updated_unix_ms = now_unix_ms();
            // Launched or ended: nothing is left to complete.
            record.launch = None;
            self.put_run(tx, &record)?;
            if state.is_final() {
                self.remember_final(tx, run_id)?;
            }
            self.append_in(tx, run_id, state, report).map(Some)
        })
    }

    /// The record of one run, if known.
    pub fn run(&self, run_id: &RunId) -> Result<Option<RunRecord>, StateError> {
        self.read(|tx| {
            let runs = match tx.open_table(RUNS) {
                Ok(t) => t,
                Err(redb::TableError::TableDoesNotExist(_)) => return Ok(None),
                Err(e) => return Err(self.fail(e)),
            };
            let bytes = runs.get(run_id.as_str()).map_err(|e| self.fail(e))?;
            bytes
                .map(|b| {
                    serde_json::from_slice(b.value())
                        .map_err(|e| self.corrupt("run", run_id.as_str(), e))
                })
                .transpose()
        })
    }

    /// Every known run, in run-id order.
    pub fn runs(&self) -> Result<Vec<RunRecord>, StateError> {
        self.read(|tx| {
            let runs = match tx.open_table(RUNS) {
                Ok(t) => t,
                Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
                Err(e) => return Err(self.fail(e)),
            };
            let mut out = Vec::new();
            for entry in runs.iter().map_err(|e| self.fail(e))? {
                let (id, bytes) = entry.map_err(|e| self.fail(e))?;
                let record = serde_json::from_slice(bytes.value())
                    .map_err(|e| self.corrupt("run", id.value(), e))?;
                out.push(record);
            }
            Ok(out)
        })
    }

    /// The known runs not yet in a final state: the ones to re-adopt and watch.
    pub fn active_runs(&self) -> Result<Vec<RunRecord>, StateError> {
        let mut runs = self.runs()?;
        runs.retain(|r| !r.state.is_final());
        Ok(runs)
    }

    fn get_run(
        &self,
        tx: &WriteTransaction,
        run_id: &RunId,
    ) -> Result<Option<RunRecord>, StateError> {
        let runs = tx.open_table(RUNS).map_err(|e| self.fail(e))?;
        let bytes = runs.get(run_id.as_str()).map_err(|e| self.fail(e))?;
        bytes
            .map(|b| {
                serde_json::from_slice(b.value())
                    .map_err(|e| self.corrupt("run", run_id.as_str(), e))
            })
            .transpose()
    }

    fn put_run(&self, tx: &WriteTransaction, record: &RunRecord) -> Result<(), StateError> {
        // Cannot fail: run records are plain data with string keys, which always serialize.
        let bytes = serde_json::to_vec(record).expect("a run record serializes");
        let mut runs = tx.open_table(RUNS).map_err(|e| self.fail(e))?;
        runs.insert(record.run_id.as_str(), bytes.as_slice())
            .map_err(|e| self.fail(e))?;
        Ok(())
    }

    /// Notes a run as final and forgets the oldest final records beyond [`KEEP_FINAL_RUNS`].
    fn remember_final(&self, tx: &WriteTransaction, run_id: &RunId) -> Result<(), StateError> {
        self.remember_in_order(
            tx,
            FINAL_ORDER,
            RUNS,
            META_FINAL_SEQ,
            run_id.as_str(),
            KEEP_FINAL_RUNS,
        )
    }
}
