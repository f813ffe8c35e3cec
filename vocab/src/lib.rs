//! The words every part of the fleet shares, each a type of its own so one is never passed where
//! another belongs: content digests, run ids, the node protocol's ids, and bytes that may not be
//! text. Every one travels as its text (JSON, command lines, file names) and is checked where it
//! is read.
//!
//! At the bottom of the workspace: the run store, the supervisor, the node protocol, the agent,
//! the coordinator and `oci` all use it; it depends on nothing of theirs.
mod bytes;
mod digest;
mod ids;
mod run_id;

pub use bytes::Bytes;
pub use digest::{Digest, DigestError};
pub use ids::{NodeId, OpId, SetId, UploadId};
pub use run_id::{RunId, RunIdError};
