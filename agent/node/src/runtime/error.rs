//! What a runtime call can fail with: one line per run, naming the run and what to do.
use fleet_proto::RunId;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// The start named a digest that was never staged.
    #[error(
        "run {run_id}: program {program} is not staged on this node; stage it before starting the run"
    )]
    UnknownProgram { run_id: RunId, program: String },
    /// The run asks for something this runtime cannot do (a workload kind, a limit, devices).
    #[error("run {run_id}: {what} is not supported by the {runtime} runtime; {hint}")]
    Unsupported {
        run_id: RunId,
        what: String,
        runtime: &'static str,
        hint: &'static str,
    },
    /// An image was asked for and no Docker engine answers; programs still run.
    #[error("run {run_id}: images need a Docker engine and none answers: {reason}")]
    NoEngine { run_id: RunId, reason: String },
    /// A collected file over the caller's limit; nothing was sent.
    #[error(
        "run {run_id}: {path} is {size} bytes, over the {limit} byte limit; raise --max-bytes or collect a smaller file"
    )]
    TooLarge {
        run_id: RunId,
        path: String,
        size: u64,
        limit: u64,
    },
    /// The runtime holds no run with this id.
    #[error("run {run_id} is not known to this node's runtimes; check the run id")]
    UnknownRun { run_id: RunId },
    /// A collect path that would leave the run's folder.
    #[error("run {run_id}: collect path {path} leaves the run folder; name a file inside it")]
    PathEscapes { run_id: RunId, path: String },
    /// The disk under the run store filled up (typically while copying inputs). The detail is
    /// the supervisor's line, which already says what to do.
    #[error("run {run_id}: the run store's disk is full: {detail}")]
    NoSpace { run_id: RunId, detail: String },
    /// Any other refusal, carrying the runtime's own one-line reason.
    #[error("run {run_id}: {reason}")]
    Refused { run_id: RunId, reason: String },
    /// A refusal not tied to one run (staging, listing).
    #[error("{what} failed: {reason}")]
    Failed { what: String, reason: String },
    /// The supervisor binary could not be executed at all.
    #[error(
        "cannot run the supervisor {path}: {reason}; ship fleet-run-supervisor beside fleet-agent or pass its path"
    )]
    Spawn { path: PathBuf, reason: String },
    /// The supervisor answered something this agent cannot parse: a version mismatch.
    #[error(
        "the supervisor's answer to {what} does not parse ({reason}); ship the fleet-run-supervisor built with this agent"
    )]
    Protocol { what: String, reason: String },
}

impl RuntimeError {
    /// The refusal class the coordinator sees for this error.
    pub fn class(&self) -> fleet_proto::protocol::RefusalClass {
        use fleet_proto::protocol::RefusalClass as C;
        match self {
            RuntimeError::UnknownProgram { .. } => C::NotStaged,
            RuntimeError::UnknownRun { .. } => C::UnknownRun,
            RuntimeError::PathEscapes { .. } => C::PathEscapes,
            RuntimeError::NoSpace { .. } => C::NoSpace,
            RuntimeError::Unsupported { .. }
            | RuntimeError::NoEngine { .. }
            | RuntimeError::TooLarge { .. } => C::Unsupported,
            _ => C::Other,
        }
    }
}
