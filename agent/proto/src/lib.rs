//! The node protocol, shared by the machine's agent (`fleet-agent`) and the coordinator
//! (`fleet-coordinator`): messages and framing, pinned TLS, join files, facts, runs.
//!
//! API: every module is public; `protocol` and `run` are the wire, `pin` and `joinfile` the
//! trust, `facts` what a machine reports. `binary`, `fsutil`, `duration` and `logging` are the
//! small helpers both binaries share.
pub mod binary;
pub mod content;
pub mod dial;
pub mod duration;
pub mod facts;
pub mod fsutil;
pub mod joinfile;
pub mod logging;
pub mod pin;
pub mod protocol;
pub mod run;

pub use run_store::{Bytes, Digest};
