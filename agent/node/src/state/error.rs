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
    /// A read or write failed after the store was opened (an I/O error).
    #[error("agent state {path} failed: {source}; check the disk under the state directory")]
    Store {
        path: PathBuf,
        source: Box<redb::Error>,
    },
    /// The disk holding the store is full: the write did not happen, earlier ones stand.
    #[error(
        "agent state {path} cannot be written: no space left on device (the disk holding {}); free space there, the agent carries on by itself once there is room",
        dir.display()
    )]
    NoSpace { path: PathBuf, dir: PathBuf },
    /// A command carries a session generation older than one already seen.
    #[error(
        "command from session generation {got} refused: generation {current} superseded it; reconnect to get a current session"
    )]
    Superseded { got: u64, current: u64 },
    /// A state change for a run the node never tracked.
    #[error("run {run_id} is not known to this node; start it before reporting its state")]
    UnknownRun { run_id: fleet_proto::RunId },
    /// Work on the store from async code stopped before it returned (it panicked).
    #[error(transparent)]
    Unfinished(#[from] fleet_cli::blocking::Unfinished),
}

impl StateError {
    /// A redb error on the store at `path`.
    pub(super) fn store(path: &Path, e: redb::Error) -> StateError {
        match &e {
            redb::Error::Io(io) if is_no_space(io) => StateError::NoSpace {
                path: path.to_path_buf(),
                dir: path.parent().unwrap_or(path).to_path_buf(),
            },
            _ => StateError::Store {
                path: path.to_path_buf(),
                source: Box::new(e),
            },
        }
    }

    /// Whether redb must be closed and reopened before the store is used again: after any I/O
    /// failure redb refuses every later call ("Previous I/O error occurred").
    pub(super) fn needs_reopen(&self) -> bool {
        match self {
            StateError::NoSpace { .. } => true,
            StateError::Store { source, .. } => {
                matches!(**source, redb::Error::Io(_) | redb::Error::PreviousIo)
            }
            _ => false,
        }
    }

    /// Classifies an error from opening an existing file.
    pub(super) fn open(path: &Path, e: redb::DatabaseError) -> StateError {
        use redb::{DatabaseError, StorageError};
        if let DatabaseError::Storage(StorageError::Io(io)) = &e
            && is_no_space(io)
        {
            return StateError::NoSpace {
                dir: path.parent().unwrap_or(path).to_path_buf(),
                path: path.to_path_buf(),
            };
        }
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

/// ENOSPC, or EDQUOT (a quota is as full as a disk).
fn is_no_space(io: &std::io::Error) -> bool {
    io.kind() == std::io::ErrorKind::StorageFull || matches!(io.raw_os_error(), Some(28 | 122))
}

/// redb's messages start with a capital; ours are lowercase lines.
fn lowercase_first(s: &str) -> String {
    let mut chars = s.chars();
    match chars.next() {
        Some(c) => c.to_lowercase().chain(chars).collect(),
        None => String::new(),
    }
}
