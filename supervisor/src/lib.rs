//! The run store's on-disk format, shared with the agent: paths, run ids, digests, the
//! `result.json` and `supervisor.json` schemas, how a reader tells a run's state (lost included),
//! and the binary's command line (`cli`: built by the agent, parsed by the binary).
//!
//! This half spawns no process and links no async runtime, so the agent can depend on it.
//! The `fleet-run-supervisor` binary (in `main.rs`) is the only writer of a run.
pub mod atomic;
pub mod cli;
pub mod clock;
pub mod digest;
pub mod error;
pub mod exit;
pub mod inside;
pub mod layout;
pub mod lock;
pub mod record;
pub mod run_id;
pub mod state;

pub use digest::Digest;
pub use error::{Error, describe_io};
pub use exit::Refusal;
pub use layout::Store;
pub use record::{Bytes, Failure, Owner, RunResult, Step, StreamRecord};
pub use run_id::RunId;
pub use state::{RunStatus, State};
