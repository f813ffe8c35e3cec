//! The run API, mirroring the hub's `fleet.run`, `fleet.run.status` and `fleet.run.collect`: a set
//! has one row per machine; rows wait for their machine, then follow its events to a final state.
use super::store::{RunRow, is_final};
use super::{Coordinator, CoordinatorError};
use crate::fsutil::now_ms;
use crate::protocol::{Command, RunOptions};
use base64::Engine;
use rand::RngCore;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::sync::Mutex;
use tokio::sync::{mpsc, oneshot, watch};

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

/// What to run, and where.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunRequest {
    /// A node id or name; None with `all`.
    pub node: Option<String>,
    #[serde(default)]
    pub all: bool,
    pub program_b64: String,
    #[serde(flatten)]
    pub options: RunOptions,
    /// Runs per selected node (default 1).
    #[serde(default = "one")]
    pub repeat: u32,
    /// For protocol-skew testing: each row's node gets this command object as-is, in place of
    /// the start (under the start's op id, so the node's answer settles the row).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub raw_command: Option<serde_json::Value>,
}

fn one() -> u32 {
    1
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SetView {
    pub set_id: String,
    pub program: String,
    pub runs: Vec<String>,
}

/// One status row.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunView {
    pub run_id: String,
    pub set_id: String,
    pub node_id: String,
    pub state: String,
    pub exit_code: Option<i64>,
    pub timed_out: bool,
    /// `coordinator stop` ended it.
    #[serde(default)]
    pub stopped: bool,
    pub error: Option<String>,
    pub events: Vec<u64>,
    pub result: Option<serde_json::Value>,
}

impl From<RunRow> for RunView {
    fn from(row: RunRow) -> RunView {
        let result = row.result.as_ref();
        // The supervisor's status JSON holds result.json under `result` once the run ended.
        let record = result.map(|r| r.get("result").unwrap_or(r));
        let flag = |name: &str| {
            record
                .and_then(|r| r.get(name))
                .and_then(|v| v.as_bool())
                .unwrap_or(false)
        };
        RunView {
            exit_code: record
                .and_then(|r| r.get("exit_code"))
                .and_then(|v| v.as_i64()),
            timed_out: flag("timed_out"),
            stopped: flag("stopped"),
            events: row.events.iter().map(|e| e.id).collect(),
            run_id: row.id,
            set_id: row.set_id,
            node_id: row.node_id,
            state: row.state,
            error: row.error,
            result: row.result,
        }
    }
}

/// A request to a node through its live session, answered with the command's result.
pub type NodeCall = (Command, oneshot::Sender<serde_json::Value>);

/// The serving coordinator's live side: which nodes have a session, and a change counter that
/// wakes sessions when new runs wait for them.
pub struct Live {
    pub changes: watch::Sender<u64>,
    pub sessions: Mutex<HashMap<String, (u64, mpsc::Sender<NodeCall>)>>,
}

impl Default for Live {
    fn default() -> Live {
        Live {
            changes: watch::channel(0).0,
            sessions: Mutex::new(HashMap::new()),
        }
    }
}

impl Live {
    pub fn poke(&self) {
        self.changes.send_modify(|n| *n += 1);
    }
}

fn random_id(prefix: &str) -> String {
    let mut raw = [0u8; 6];
    rand::thread_rng().fill_bytes(&mut raw);
    format!("{prefix}-{}", hex::encode(raw))
}

impl Coordinator {
    /// Records a set with one waiting run per selected node, and wakes their sessions.
    pub fn create_runs(&self, request: &RunRequest) -> Result<SetView, CoordinatorError> {
        let program = B64
            .decode(&request.program_b64)
            .map_err(|_| CoordinatorError::Request("the program is not base64".into()))?;
        let digest = format!("sha256:{}", hex::encode(Sha256::digest(&program)));
        let nodes = self.store.nodes()?;
        let selected: Vec<String> = match (&request.node, request.all) {
            (_, true) => nodes.iter().map(|n| n.id.clone()).collect(),
            (Some(wanted), false) => nodes
                .iter()
                .filter(|n| &n.id == wanted || n.name.as_deref() == Some(wanted))
                .map(|n| n.id.clone())
                .collect(),
            (None, false) => {
                return Err(CoordinatorError::Request("pass --node N or --all".into()));
            }
        };
        if selected.is_empty() {
            return Err(CoordinatorError::Request(match &request.node {
                Some(wanted) => {
                    format!("no node matches {wanted}: see `fleet-agent coordinator nodes`")
                }
                None => {
                    "no node has joined yet: mint a join file with `fleet-agent coordinator token`"
                        .into()
                }
            }));
        }
        self.store.put_program(&digest, &program)?;
        let set_id = random_id("s");
        let now = now_ms();
        let runs: Vec<RunRow> = selected
            .iter()
            .flat_map(|node| std::iter::repeat_n(node.clone(), request.repeat.max(1) as usize))
            .map(|node_id| RunRow {
                id: random_id("r"),
                set_id: set_id.clone(),
                node_id,
                state: "waiting".into(),
                program: digest.clone(),
                options: request.options.clone(),
                created_ms: now,
                updated_ms: now,
                accepted: false,
                result: None,
                error: None,
                events: Vec::new(),
                raw_command: request.raw_command.clone(),
            })
            .collect();
        self.store.create_set(&set_id, &runs)?;
        self.live.poke();
        Ok(SetView {
            set_id,
            program: digest,
            runs: runs.into_iter().map(|r| r.id).collect(),
        })
    }

    /// The rows of a set, or the one row of a run.
    pub fn status(
        &self,
        set: Option<&str>,
        run: Option<&str>,
    ) -> Result<Vec<RunView>, CoordinatorError> {
        let rows = match (set, run) {
            (Some(set), _) => self.store.set_runs(set)?.ok_or_else(|| {
                CoordinatorError::Request(format!("no set {set}: it never existed or was pruned"))
            })?,
            (None, Some(run)) => vec![self.known_run(run)?],
            (None, None) => {
                return Err(CoordinatorError::Request(
                    "pass --set ID or --run ID".into(),
                ));
            }
        };
        Ok(rows.into_iter().map(RunView::from).collect())
    }

    /// Fetches a file from a run's folder through its node's live session.
    pub async fn collect(
        &self,
        run: &str,
        path: &str,
    ) -> Result<serde_json::Value, CoordinatorError> {
        let row = self.known_run(run)?;
        let command = Command::Collect {
            run_id: run.to_string(),
            path: path.to_string(),
        };
        self.call_node(&row, "collect", command).await
    }

    /// Stops a run through its node's live session. The node answers once the run ended; the
    /// row follows with the run's final event, its record saying it was stopped.
    pub async fn stop(&self, run: &str) -> Result<serde_json::Value, CoordinatorError> {
        let row = self.known_run(run)?;
        if is_final(&row.state) {
            return Err(CoordinatorError::Request(format!(
                "run {run} already ended ({}): there is nothing to stop",
                row.state
            )));
        }
        if !row.accepted {
            return Err(CoordinatorError::Request(format!(
                "run {run} has not reached node {} yet: stop it once `status` shows it starting or running",
                row.node_id
            )));
        }
        let command = Command::Stop {
            run_id: run.to_string(),
        };
        self.call_node(&row, "stop", command).await
    }

    fn known_run(&self, run: &str) -> Result<RunRow, CoordinatorError> {
        self.store.run(run)?.ok_or_else(|| {
            CoordinatorError::Request(format!("no run {run}: it never existed or was pruned"))
        })
    }

    /// Sends `command` to the node of `row` over its live session (`what` names the operator
    /// command for the error when there is none) and returns the node's `ok` answer.
    async fn call_node(
        &self,
        row: &RunRow,
        what: &str,
        command: Command,
    ) -> Result<serde_json::Value, CoordinatorError> {
        let link = self
            .live
            .sessions
            .lock()
            .expect("sessions")
            .get(&row.node_id)
            .map(|(_, tx)| tx.clone());
        let Some(link) = link else {
            return Err(CoordinatorError::Request(format!(
                "node {} has no session now: {what} needs it connected to a serving coordinator",
                row.node_id
            )));
        };
        let (reply, answer) = oneshot::channel();
        let gone = || {
            CoordinatorError::Request(format!("node {} went away before answering", row.node_id))
        };
        link.send((command, reply)).await.map_err(|_| gone())?;
        let result = tokio::time::timeout(std::time::Duration::from_secs(60), answer)
            .await
            .map_err(|_| gone())?
            .map_err(|_| gone())?;
        match result.get("ok") {
            Some(ok) => Ok(ok.clone()),
            None => Err(CoordinatorError::Request(
                result["error"]
                    .as_str()
                    .unwrap_or("the node refused")
                    .to_string(),
            )),
        }
    }

    /// Final-state sweep: runs nobody took within `waiting_timeout` fail; runs whose node lost
    /// its lease (while this coordinator has been up long enough to know) are `lost`.
    pub fn sweep(
        &self,
        waiting_timeout_ms: u64,
        up_since_ms: u64,
        lease_ms: u64,
    ) -> Result<(), CoordinatorError> {
        let now = now_ms();
        let nodes: HashMap<String, u64> = self
            .store
            .nodes()?
            .into_iter()
            .map(|n| (n.id, n.lease_until_ms))
            .collect();
        for row in self.store.active_runs()? {
            let lease_until = nodes.get(&row.node_id).copied().unwrap_or(0);
            let verdict = if row.state == "waiting" {
                (now > row.created_ms + waiting_timeout_ms).then(|| {
                    (
                        "failed",
                        format!(
                            "node {} did not take the run within {} s",
                            row.node_id,
                            waiting_timeout_ms / 1000
                        ),
                    )
                })
            } else {
                (now > lease_until && now > up_since_ms + lease_ms).then(|| {
                    (
                        "lost",
                        format!(
                            "node {} stopped answering while the run was {}",
                            row.node_id, row.state
                        ),
                    )
                })
            };
            if let Some((state, reason)) = verdict {
                self.store.update_run(&row.id, &mut |r| {
                    if !is_final(&r.state) {
                        r.state = state.to_string();
                        r.error = Some(reason.clone());
                    }
                })?;
            }
        }
        Ok(())
    }
}
