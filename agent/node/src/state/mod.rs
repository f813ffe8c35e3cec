//! The node's one durable store, `<state-dir>/agent.redb`: applied operations, the event spool, known runs, fencing.
//!
//! Every write commits with [`redb::Durability::Immediate`] before the method returns, so a caller that
//! reports something after a write never reports what a crash could take back. The store fails closed: a
//! file it cannot read, or one of another schema version, is an error naming the file, never a fresh store.
//!
//! A write that fails on I/O (a full disk) leaves redb unusable until the file is reopened, so the
//! store closes its database then and reopens it at the next call: once there is room again the
//! agent works on without a restart, and every transaction committed before is still there.
//!
//! The methods block on disk I/O (an fsync per write): call them from `tokio::task::spawn_blocking` in
//! async code. [`Store`] is `Send + Sync`; share it with an `Arc`.

mod error;
mod fence;
mod ops;
mod runs;
mod spool;

pub use error::StateError;
pub use fleet_proto::run::Event;
pub use runs::{KEEP_FINAL_RUNS, Launch, RunRecord};

use redb::{
    Database, Durability, ReadableTable, ReadableTableMetadata, TableDefinition, WriteTransaction,
};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

/// The file name of the store inside the state directory.
pub const FILE_NAME: &str = "agent.redb";

/// The schema version this code reads and writes; any other version is refused.
/// 2: events carry a typed `report` and runs a `workload` (the protocol crate's types).
pub const SCHEMA_VERSION: u64 = 2;

/// Counters and the schema version.
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const META_SCHEMA: &str = "schema";

/// The node's durable store. Open it once per process: redb locks the file.
pub struct Store {
    /// None after an I/O failure closed it; reopened by the next call.
    db: Mutex<Option<Database>>,
    path: PathBuf,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("path", &self.path).finish()
    }
}

impl Store {
    /// Opens `<state_dir>/agent.redb`, creating it (and the directory) when it does not exist yet.
    ///
    /// An existing file is only ever opened, never re-initialised: an empty, corrupt or foreign file,
    /// or one of another schema version, is an error.
    pub fn open(state_dir: &Path) -> Result<Store, StateError> {
        let path = state_dir.join(FILE_NAME);
        if !path.exists() {
            create(state_dir, &path)?;
        }
        let db = open_existing(&path)?;
        let store = Store {
            db: Mutex::new(Some(db)),
            path,
        };
        store.check_schema()?;
        Ok(store)
    }

    /// Runs `f` on the database, reopening it first when an I/O failure closed it, and closing
    /// it when `f` fails on I/O (redb refuses every later call until it is reopened).
    fn with_db<T>(
        &self,
        f: impl FnOnce(&Database) -> Result<T, StateError>,
    ) -> Result<T, StateError> {
        let mut db = self.db.lock().unwrap_or_else(PoisonError::into_inner);
        if db.is_none() {
            *db = Some(open_existing(&self.path)?);
            tracing::info!(path = %self.path.display(), "agent state reopened after an I/O failure");
        }
        // Cannot fail: the branch above opened the database into the slot.
        let result = f(db.as_ref().expect("opened above"));
        if let Err(e) = &result
            && e.needs_reopen()
        {
            tracing::warn!("{e}");
            *db = None;
        }
        result
    }

    /// The path of the store's file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn check_schema(&self) -> Result<(), StateError> {
        let tx = self.with_db(|db| db.begin_read().map_err(|e| self.fail(e)))?;
        let found = match tx.open_table(META) {
            Ok(meta) => meta
                .get(META_SCHEMA)
                .map_err(|e| self.fail(e))?
                .map(|v| v.value()),
            Err(redb::TableError::TableDoesNotExist(_)) => None,
            Err(e) => return Err(self.fail(e)),
        };
        match found {
            Some(SCHEMA_VERSION) => Ok(()),
            Some(found) => Err(StateError::Schema {
                path: self.path.clone(),
                found,
                expected: SCHEMA_VERSION,
            }),
            None => Err(StateError::Unreadable {
                path: self.path.clone(),
                reason: "it is a redb file without the agent's schema version".into(),
            }),
        }
    }

    /// Runs `f` in one write transaction and commits it durably before returning.
    fn write<T>(
        &self,
        f: impl FnOnce(&WriteTransaction) -> Result<T, StateError>,
    ) -> Result<T, StateError> {
        self.with_db(|db| {
            let mut tx = db.begin_write().map_err(|e| self.fail(e))?;
            tx.set_durability(Durability::Immediate);
            let value = f(&tx)?;
            tx.commit().map_err(|e| self.fail(e))?;
            Ok(value)
        })
    }

    /// Runs `f` in one read transaction.
    fn read<T>(
        &self,
        f: impl FnOnce(&redb::ReadTransaction) -> Result<T, StateError>,
    ) -> Result<T, StateError> {
        self.with_db(|db| {
            let tx = db.begin_read().map_err(|e| self.fail(e))?;
            f(&tx)
        })
    }

    /// Wraps a redb error with the store's path; a full disk is named as such.
    fn fail(&self, e: impl Into<redb::Error>) -> StateError {
        StateError::store(&self.path, e.into())
    }

    /// Reads a counter in `META` inside a write transaction, 0 when absent.
    fn counter(&self, tx: &WriteTransaction, name: &str) -> Result<u64, StateError> {
        let meta = tx.open_table(META).map_err(|e| self.fail(e))?;
        let value = meta.get(name).map_err(|e| self.fail(e))?;
        Ok(value.map(|v| v.value()).unwrap_or(0))
    }

    /// Advances a counter in `META` and returns its new value (1 the first time).
    fn take_next(&self, tx: &WriteTransaction, name: &str) -> Result<u64, StateError> {
        let next = self.counter(tx, name)? + 1;
        let mut meta = tx.open_table(META).map_err(|e| self.fail(e))?;
        meta.insert(name, next).map_err(|e| self.fail(e))?;
        Ok(next)
    }

    /// Notes `key` as the newest entry of an insertion-order table and forgets the oldest keys
    /// beyond `keep`, from the order and from `data`, in the caller's transaction.
    fn remember_in_order(
        &self,
        tx: &WriteTransaction,
        order: TableDefinition<u64, &str>,
        data: TableDefinition<&str, &[u8]>,
        seq_name: &str,
        key: &str,
        keep: u64,
    ) -> Result<(), StateError> {
        let seq = self.take_next(tx, seq_name)?;
        let mut order = tx.open_table(order).map_err(|e| self.fail(e))?;
        order.insert(seq, key).map_err(|e| self.fail(e))?;
        let mut data = tx.open_table(data).map_err(|e| self.fail(e))?;
        while order.len().map_err(|e| self.fail(e))? > keep {
            let Some((_, old)) = order.pop_first().map_err(|e| self.fail(e))? else {
                break;
            };
            data.remove(old.value()).map_err(|e| self.fail(e))?;
        }
        Ok(())
    }

    /// A JSON record that does not decode: the file was damaged or written by something else.
    fn corrupt(&self, what: &str, key: &str, e: serde_json::Error) -> StateError {
        StateError::Unreadable {
            path: self.path.clone(),
            reason: format!("its {what} record {key} does not decode: {e}"),
        }
    }
}

/// Opens an existing file. redb asserts on some damage (a truncated file) instead of returning
/// an error; that panic is turned into the same fail-closed error where panics unwind. (Under
/// `panic = "abort"` the process stops there instead: still before anything was run or reported.)
fn open_existing(path: &Path) -> Result<Database, StateError> {
    match std::panic::catch_unwind(|| Database::open(path)) {
        Ok(opened) => opened.map_err(|e| StateError::open(path, e)),
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            Err(StateError::Unreadable {
                path: path.to_path_buf(),
                reason: format!("it is truncated or damaged (redb: {what})"),
            })
        }
    }
}

/// The current wall clock in milliseconds since the Unix epoch (0 if the clock is before it).
fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Creates a fresh store beside its final name and renames it into place, so a crash mid-creation
/// leaves no half-initialised `agent.redb` that a later start would have to guess about.
fn create(state_dir: &Path, path: &Path) -> Result<(), StateError> {
    let failed = |reason: String| StateError::Create {
        path: path.to_path_buf(),
        reason,
    };
    std::fs::create_dir_all(state_dir).map_err(|e| failed(e.to_string()))?;
    let tmp = path.with_extension("redb.tmp");
    // A leftover temporary file never became the store; it holds nothing anyone was told about.
    let _ = std::fs::remove_file(&tmp);
    let init = || -> Result<(), Box<redb::Error>> {
        let db = Database::create(&tmp).map_err(|e| Box::new(e.into()))?;
        let mut tx = db.begin_write().map_err(|e| Box::new(e.into()))?;
        tx.set_durability(Durability::Immediate);
        tx.open_table(META)
            .map_err(|e| Box::new(e.into()))?
            .insert(META_SCHEMA, SCHEMA_VERSION)
            .map_err(|e| Box::new(e.into()))?;
        tx.commit().map_err(|e| Box::new(e.into()))?;
        Ok(())
    };
    init().map_err(|e| failed(e.to_string()))?;
    std::fs::rename(&tmp, path).map_err(|e| failed(e.to_string()))?;
    std::fs::File::open(state_dir)
        .and_then(|dir| dir.sync_all())
        .map_err(|e| failed(e.to_string()))
}

#[cfg(test)]
mod tests;
