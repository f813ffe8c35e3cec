//! What can go wrong with the node's store, each as one line naming the file and what to do.
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// The file exists but is not a store this agent can read. The agent must stop, never start over.
    #[error(
        "agent state {path} cannot be read: {reason}; restore it or move it aside deliberately, the agent never starts over on its own"
    )]
    Unreadable { path: PathBuf, reason: String },
    /// The file was written with another schema version.
    #[error(
        "agent state {path} has schema version {found} but this agent reads version {expected}; run the agent version that wrote it"
    )]
    Schema {
        path: PathBuf,
        found: u64,
        expected: u64,
    },
    /// Another process holds the store's lock.
    #[error(
        "agent state {path} is in use by another process; stop the other fleet-agent using this state directory"
    )]
    InUse { path: PathBuf },
    /// The store could not be created.
    #[error("cannot create agent state {path}: {reason}; make the state directory writable")]
    Create { path: PathBuf, reason: String },
    /// A read or write failed after the store was opened (disk full, I/O error).
    #[error("agent state {path} failed: {source}; check the disk under the state directory")]
    Store {
        path: PathBuf,
        source: Box<redb::Error>,
    },
    /// A command carries a session generation older than one already seen.
    #[error(
        "command from session generation {got} refused: generation {current} superseded it; reconnect to get a current session"
    )]
    Superseded { got: u64, current: u64 },
    /// A state change for a run the node never tracked.
    #[error("run {run_id} is not known to this node; start it before reporting its state")]
    UnknownRun { run_id: String },
}

impl StateError {
    /// Classifies an error from opening an existing file.
    pub(super) fn open(path: &Path, e: redb::DatabaseError) -> StateError {
        use redb::{DatabaseError, StorageError};
        let path = path.to_path_buf();
        let reason = match e {
            DatabaseError::DatabaseAlreadyOpen => return StateError::InUse { path },
            DatabaseError::Storage(StorageError::Io(io))
                if io.kind() == std::io::ErrorKind::WouldBlock =>
            {
                return StateError::InUse { path };
            }
            DatabaseError::Storage(StorageError::Io(io))
                if io.kind() == std::io::ErrorKind::InvalidData =>
            {
                "it is not a redb database (empty, truncated or overwritten)".to_string()
            }
            DatabaseError::Storage(StorageError::Corrupted(what)) => {
                format!("it is corrupt ({})", lowercase_first(&what))
            }
            DatabaseError::UpgradeRequired(version) => {
                format!("it uses redb file format {version}, which this agent cannot read")
            }
            e => lowercase_first(&e.to_string()),
        };
        StateError::Unreadable { path, reason }
    }
}

/// redb's messages start with a capital; ours are lowercase lines.
fn lowercase_first(s: &str) -> String {
    let mut chars = s.chars();
    match chars.next() {
        Some(c) => c.to_lowercase().chain(chars).collect(),
        None => String::new(),
    }
}
