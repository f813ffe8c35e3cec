//! What a coordinator call can fail with, each one line that says what to do.
use crate::store::StoreError;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum CoordinatorError {
    #[error("cannot use the coordinator data directory {}: {cause}", path.display())]
    DataDir {
        path: PathBuf,
        cause: std::io::Error,
    },
    #[error("the coordinator key {} is corrupt ({reason}): restore it; a new key would orphan every node", path.display())]
    CorruptKey { path: PathBuf, reason: String },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(
        "no address to put in the join file: pass --address HOST:PORT (the coordinator is not serving from this data directory)"
    )]
    NoAddress,
    #[error("{0}")]
    Request(String),
    /// The node refused the command: its class is what a caller acts on, its line what people read.
    #[error(transparent)]
    Refused(#[from] fleet_proto::protocol::Refusal),
    #[error(
        "--store takes a PostgreSQL URL, postgres://USER[:PASSWORD]@HOST[:PORT]/DATABASE, not `{0}`; leave it out for the embedded store in the data directory"
    )]
    StoreChoice(String),
    #[error("cannot read the bundle {}: {cause}: build it with `cargo xtask dist`", path.display())]
    Bundle {
        path: PathBuf,
        cause: std::io::Error,
    },
}
