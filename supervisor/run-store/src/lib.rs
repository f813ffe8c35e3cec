//! The run store's on-disk format, shared with the agent: paths, the `result.json` and
//! `supervisor.json` schemas, how a reader tells a run's state (lost included), and the
//! binary's command line (`cli`: built by the agent, parsed by the binary). Run ids, digests and
//! bytes are the workspace's own words, from `fleet-vocab`.
//!
//! This crate spawns no process and links no async runtime, so the agent can depend on it.
//! The `fleet-run-supervisor` binary is the only writer of a run.
pub mod atomic;
pub mod cli;
pub mod clock;
pub mod error;
pub mod exit;
pub mod inside;
pub mod layout;
pub mod lock;
pub mod record;
pub mod state;

pub use error::{Error, describe_io};
pub use exit::Refusal;
pub use fleet_vocab::{Bytes, Digest, RunId};
pub use layout::Store;
pub use record::{Failure, Owner, RunResult, Step, StreamRecord};
pub use state::{RunStatus, State};
