//! The narrow interface between the agent and what runs programs: stage, start, stop, status,
//! collect, list; [`ProcessRuntime`] drives `fleet-run-supervisor`, a container runtime plugs in beside it.
//!
//! The interface is blocking on purpose: each call is a short child process (or, later, a short
//! HTTP call to a daemon). Async callers wrap calls in `tokio::task::spawn_blocking`, so the agent's
//! loop never stalls on a slow disk, and runtimes stay free of any async runtime.

mod error;
mod process;
mod watch;

pub use error::RuntimeError;
pub use process::{DEFAULT_ROOT, ProcessRuntime, SUPERVISOR_NAME};
pub use watch::{SyncReport, sync_runs};

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

/// A run's state as the agent reports it (the coordinator adds `waiting` before a node answers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RunState {
    Starting,
    Running,
    Finished,
    Failed,
    Lost,
}

impl RunState {
    /// Whether nothing can follow this state.
    pub fn is_final(self) -> bool {
        matches!(self, RunState::Finished | RunState::Failed | RunState::Lost)
    }

    /// Whether a run in `self` may move to `next`: only forward, and never out of a final state.
    pub fn may_become(self, next: RunState) -> bool {
        !self.is_final() && next.rank() > self.rank()
    }

    fn rank(self) -> u8 {
        match self {
            RunState::Starting => 0,
            RunState::Running => 1,
            RunState::Finished | RunState::Failed | RunState::Lost => 2,
        }
    }

    /// The lowercase name used on the wire and in events.
    pub fn as_str(self) -> &'static str {
        match self {
            RunState::Starting => "starting",
            RunState::Running => "running",
            RunState::Finished => "finished",
            RunState::Failed => "failed",
            RunState::Lost => "lost",
        }
    }
}

impl std::fmt::Display for RunState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Everything needed to start one run of a staged program.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunSpec {
    pub run_id: String,
    /// The staged program's digest, `sha256:HEX`.
    pub program: String,
    /// Arguments after the program, as raw bytes (not necessarily UTF-8).
    pub argv: Vec<OsString>,
    pub timeout: Option<Duration>,
    /// Time between the polite stop signal and the kill, when the runtime supports one.
    pub grace: Option<Duration>,
    /// Bytes kept per output stream.
    pub output_limit: Option<u64>,
    /// Environment added to the runtime's clean default, as `(NAME, VALUE)`.
    pub env: Vec<(String, String)>,
    /// Input files copied into the run before it starts, as `(NAME, FILE)`.
    pub inputs: Vec<(String, PathBuf)>,
}

impl RunSpec {
    /// A spec with only the required fields; the rest take the runtime's defaults.
    pub fn new(run_id: impl Into<String>, program: impl Into<String>) -> RunSpec {
        RunSpec {
            run_id: run_id.into(),
            program: program.into(),
            argv: Vec::new(),
            timeout: None,
            grace: None,
            output_limit: None,
            env: Vec::new(),
            inputs: Vec::new(),
        }
    }
}

/// What a start did: a redelivered start of a run that exists is harmless, not an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Started {
    /// This call launched the run.
    New,
    /// The run id was already claimed; nothing was launched.
    Already,
}

/// One run as the runtime sees it now.
#[derive(Debug, Clone, PartialEq)]
pub struct RunStatus {
    pub run_id: String,
    pub state: RunState,
    /// The runtime's own record of the run (for the process runtime, the supervisor's status
    /// JSON, holding `result.json` once the run ended); sent on as the event's payload.
    pub detail: serde_json::Value,
}

/// The operations the agent needs from a runtime. Every method blocks; see the module docs.
pub trait Runtime: Send + Sync {
    /// Stages a program file by digest and returns the digest, `sha256:HEX`.
    fn stage(&self, file: &std::path::Path) -> Result<String, RuntimeError>;
    /// Starts a run detached from the caller, so it outlives an agent restart.
    fn start(&self, spec: &RunSpec) -> Result<Started, RuntimeError>;
    /// Stops a run the way its timeout would (polite signal, then a kill after its grace) and
    /// returns once it has ended; stopping a run that already ended changes nothing.
    fn stop(&self, run_id: &str) -> Result<(), RuntimeError>;
    /// The run's current state.
    fn status(&self, run_id: &str) -> Result<RunStatus, RuntimeError>;
    /// Copies a file from the run's folder to `out` and returns its digest, `sha256:HEX`.
    fn collect(
        &self,
        run_id: &str,
        path: &str,
        out: &std::path::Path,
    ) -> Result<String, RuntimeError>;
    /// Every run the runtime holds.
    fn list(&self) -> Result<Vec<RunStatus>, RuntimeError>;
}
