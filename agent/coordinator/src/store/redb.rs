//! The embedded backend: one redb file, one table per record kind, records as JSON.
use super::{
    Backend, Layout, NodeRecord, ReadTx, RunRow, StoreError, StoreResult, TokenRecord, WriteTx,
};
use redb::{Database, ReadableTable, ReadableTableMetadata, TableDefinition, TableHandle};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::path::{Path, PathBuf};

/// sha256(token) hex -> TokenRecord JSON.
const TOKENS: TableDefinition<&str, &[u8]> = TableDefinition::new("tokens");
/// node id -> NodeRecord JSON.
const NODES: TableDefinition<&str, &[u8]> = TableDefinition::new("nodes");
/// program digest -> its bytes: what older versions kept; only emptied now (content lives in the
/// coordinator's blob store on disk).
const PROGRAMS: TableDefinition<&str, &[u8]> = TableDefinition::new("programs");
/// content digest (program or input) -> how many references stored runs hold on it.
const PROGRAM_REFS: TableDefinition<&str, u64> = TableDefinition::new("program_refs");
/// run id -> RunRow JSON.
const RUNS: TableDefinition<&str, &[u8]> = TableDefinition::new("runs");
/// set id -> JSON list of its run ids.
const SETS: TableDefinition<&str, &[u8]> = TableDefinition::new("sets");
/// Runs not yet final: run id -> node id.
const ACTIVE: TableDefinition<&str, &str> = TableDefinition::new("active_runs");
/// Final runs in the order they ended (by a sequence number), oldest first.
const FINAL: TableDefinition<u64, &str> = TableDefinition::new("final_runs");
/// `schema_version`, and `final_seq` (the last sequence number given in FINAL).
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");

const SCHEMA_KEY: &str = "schema_version";
const FINAL_SEQ_KEY: &str = "final_seq";

/// One redb file. It holds no rules: see [`super::Store`].
pub struct RedbBackend {
    db: Database,
    path: PathBuf,
}

fn fail<E: Into<redb::Error>>(e: E) -> StoreError {
    StoreError::Db(e.into().to_string())
}

impl RedbBackend {
    /// Opens the file, or makes an empty one where there is none. A file that is not a redb
    /// database is refused as it is; what the database holds is judged by [`super::Store::open`].
    pub fn open(path: &Path) -> StoreResult<RedbBackend> {
        let db = Database::create(path).map_err(|e| match e {
            redb::DatabaseError::DatabaseAlreadyOpen => StoreError::Locked(path.to_path_buf()),
            other => StoreError::Open {
                path: path.to_path_buf(),
                reason: other.to_string(),
            },
        })?;
        Ok(RedbBackend {
            db,
            path: path.to_path_buf(),
        })
    }
}

impl Backend for RedbBackend {
    fn location(&self) -> String {
        self.path.display().to_string()
    }

    fn layout(&self) -> StoreResult<Layout> {
        let tx = self.db.begin_read().map_err(fail)?;
        let mut tables = tx.list_tables().map_err(fail)?.peekable();
        if tables.peek().is_none() {
            return Ok(Layout::Blank);
        }
        if !tables.any(|t| t.name() == META.name()) {
            return Ok(Layout::Unversioned);
        }
        let meta = tx.open_table(META).map_err(fail)?;
        Ok(match meta.get(SCHEMA_KEY).map_err(fail)? {
            Some(version) => Layout::Version(version.value()),
            None => Layout::Unversioned,
        })
    }

    fn create(&self, version: u64) -> StoreResult<()> {
        let tx = self.db.begin_write().map_err(fail)?;
        tx.open_table(TOKENS).map_err(fail)?;
        tx.open_table(NODES).map_err(fail)?;
        tx.open_table(PROGRAMS).map_err(fail)?;
        tx.open_table(PROGRAM_REFS).map_err(fail)?;
        tx.open_table(RUNS).map_err(fail)?;
        tx.open_table(SETS).map_err(fail)?;
        tx.open_table(ACTIVE).map_err(fail)?;
        tx.open_table(FINAL).map_err(fail)?;
        tx.open_table(META)
            .map_err(fail)?
            .insert(SCHEMA_KEY, version)
            .map_err(fail)?;
        tx.commit().map_err(fail)
    }

    fn read(&self, f: &mut dyn FnMut(&dyn ReadTx) -> StoreResult<()>) -> StoreResult<()> {
        let tx = self.db.begin_read().map_err(fail)?;
        f(&RedbRead { tx })
    }

    fn write(&self, f: &mut dyn FnMut(&mut dyn WriteTx) -> StoreResult<()>) -> StoreResult<()> {
        let mut tx = RedbWrite {
            tx: self.db.begin_write().map_err(fail)?,
        };
        match f(&mut tx) {
            Ok(()) => tx.tx.commit().map_err(fail),
            Err(e) => {
                tx.tx.abort().map_err(fail)?;
                Err(e)
            }
        }
    }
}

struct RedbRead {
    tx: redb::ReadTransaction,
}

struct RedbWrite {
    tx: redb::WriteTransaction,
}

fn decode<T: DeserializeOwned>(key: &str, bytes: &[u8]) -> StoreResult<T> {
    serde_json::from_slice(bytes).map_err(|_| StoreError::Corrupt(key.to_string()))
}

fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec(value).expect("records serialize")
}

/// The JSON record under `key`, or None when there is none.
fn get_json<T: DeserializeOwned>(
    table: &impl ReadableTable<&'static str, &'static [u8]>,
    key: &str,
) -> StoreResult<Option<T>> {
    match table.get(key).map_err(fail)? {
        Some(v) => decode(key, v.value()).map(Some),
        None => Ok(None),
    }
}

/// Every JSON record of a table, with its key.
fn all_json<T: DeserializeOwned>(
    table: &impl ReadableTable<&'static str, &'static [u8]>,
) -> StoreResult<Vec<(String, T)>> {
    let mut out = Vec::new();
    for entry in table.iter().map_err(fail)? {
        let (k, v) = entry.map_err(fail)?;
        out.push((k.value().to_string(), decode(k.value(), v.value())?));
    }
    Ok(out)
}

/// The reads, the same over a read transaction and a write transaction.
macro_rules! reads {
    ($ty:ty) => {
        impl ReadTx for $ty {
            fn token(&self, hash: &str) -> StoreResult<Option<TokenRecord>> {
                get_json(&self.tx.open_table(TOKENS).map_err(fail)?, hash)
            }

            fn tokens(&self) -> StoreResult<Vec<(String, TokenRecord)>> {
                all_json(&self.tx.open_table(TOKENS).map_err(fail)?)
            }

            fn node(&self, id: &str) -> StoreResult<Option<NodeRecord>> {
                get_json(&self.tx.open_table(NODES).map_err(fail)?, id)
            }

            fn nodes(&self) -> StoreResult<Vec<NodeRecord>> {
                let nodes = all_json(&self.tx.open_table(NODES).map_err(fail)?)?;
                Ok(nodes.into_iter().map(|(_, node)| node).collect())
            }

            fn program_refs(&self, digest: &str) -> StoreResult<u64> {
                let refs = self.tx.open_table(PROGRAM_REFS).map_err(fail)?;
                Ok(refs.get(digest).map_err(fail)?.map_or(0, |v| v.value()))
            }

            fn run(&self, id: &str) -> StoreResult<Option<RunRow>> {
                get_json(&self.tx.open_table(RUNS).map_err(fail)?, id)
            }

            fn set(&self, id: &str) -> StoreResult<Option<Vec<String>>> {
                get_json(&self.tx.open_table(SETS).map_err(fail)?, id)
            }

            fn active(&self, node_id: Option<&str>) -> StoreResult<Vec<String>> {
                let active = self.tx.open_table(ACTIVE).map_err(fail)?;
                let mut out = Vec::new();
                for entry in active.iter().map_err(fail)? {
                    let (run, node) = entry.map_err(fail)?;
                    if node_id.is_none_or(|wanted| wanted == node.value()) {
                        out.push(run.value().to_string());
                    }
                }
                Ok(out)
            }

            fn final_count(&self) -> StoreResult<u64> {
                self.tx.open_table(FINAL).map_err(fail)?.len().map_err(fail)
            }
        }
    };
}

reads!(RedbRead);
reads!(RedbWrite);

impl WriteTx for RedbWrite {
    fn put_token(&mut self, hash: &str, token: &TokenRecord) -> StoreResult<()> {
        let mut tokens = self.tx.open_table(TOKENS).map_err(fail)?;
        tokens
            .insert(hash, encode(token).as_slice())
            .map_err(fail)
            .map(drop)
    }

    fn remove_token(&mut self, hash: &str) -> StoreResult<()> {
        let mut tokens = self.tx.open_table(TOKENS).map_err(fail)?;
        tokens.remove(hash).map_err(fail).map(drop)
    }

    fn put_node(&mut self, node: &NodeRecord) -> StoreResult<()> {
        let mut nodes = self.tx.open_table(NODES).map_err(fail)?;
        nodes
            .insert(node.id.as_str(), encode(node).as_slice())
            .map_err(fail)
            .map(drop)
    }

    fn set_program_refs(&mut self, digest: &str, refs: u64) -> StoreResult<()> {
        let mut table = self.tx.open_table(PROGRAM_REFS).map_err(fail)?;
        table.insert(digest, refs).map_err(fail).map(drop)
    }

    fn remove_program(&mut self, digest: &str) -> StoreResult<()> {
        let mut programs = self.tx.open_table(PROGRAMS).map_err(fail)?;
        programs.remove(digest).map_err(fail)?;
        let mut refs = self.tx.open_table(PROGRAM_REFS).map_err(fail)?;
        refs.remove(digest).map_err(fail).map(drop)
    }

    fn put_run(&mut self, run: &RunRow) -> StoreResult<()> {
        let mut runs = self.tx.open_table(RUNS).map_err(fail)?;
        runs.insert(run.id.as_str(), encode(run).as_slice())
            .map_err(fail)
            .map(drop)
    }

    fn remove_run(&mut self, id: &str) -> StoreResult<()> {
        let mut runs = self.tx.open_table(RUNS).map_err(fail)?;
        runs.remove(id).map_err(fail).map(drop)
    }

    fn put_set(&mut self, id: &str, run_ids: &[String]) -> StoreResult<()> {
        let mut sets = self.tx.open_table(SETS).map_err(fail)?;
        sets.insert(id, encode(&run_ids).as_slice())
            .map_err(fail)
            .map(drop)
    }

    fn remove_set(&mut self, id: &str) -> StoreResult<()> {
        let mut sets = self.tx.open_table(SETS).map_err(fail)?;
        sets.remove(id).map_err(fail).map(drop)
    }

    fn put_active(&mut self, run_id: &str, node_id: &str) -> StoreResult<()> {
        let mut active = self.tx.open_table(ACTIVE).map_err(fail)?;
        active.insert(run_id, node_id).map_err(fail).map(drop)
    }

    fn remove_active(&mut self, run_id: &str) -> StoreResult<()> {
        let mut active = self.tx.open_table(ACTIVE).map_err(fail)?;
        active.remove(run_id).map_err(fail).map(drop)
    }

    fn push_final(&mut self, run_id: &str) -> StoreResult<()> {
        let mut meta = self.tx.open_table(META).map_err(fail)?;
        let seq = meta
            .get(FINAL_SEQ_KEY)
            .map_err(fail)?
            .map_or(0, |v| v.value())
            + 1;
        meta.insert(FINAL_SEQ_KEY, seq).map_err(fail)?;
        let mut order = self.tx.open_table(FINAL).map_err(fail)?;
        order.insert(seq, run_id).map_err(fail).map(drop)
    }

    fn pop_final(&mut self) -> StoreResult<Option<String>> {
        let mut order = self.tx.open_table(FINAL).map_err(fail)?;
        let oldest = order.pop_first().map_err(fail)?;
        Ok(oldest.map(|(_, id)| id.value().to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::super::{SCHEMA_VERSION, Store, StoreError, conformance};
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// A fresh, blank redb file per call, in one temporary directory.
    fn blank_backends(dir: &Path) -> impl Fn() -> Box<dyn Backend> + '_ {
        let next = AtomicU64::new(0);
        move || {
            let n = next.fetch_add(1, Ordering::Relaxed);
            Box::new(RedbBackend::open(&dir.join(format!("store-{n}.redb"))).expect("opens"))
        }
    }

    macro_rules! conformance_tests {
        ($($rule:ident),* $(,)?) => {
            $(
                #[test]
                fn $rule() {
                    let dir = tempfile::tempdir().unwrap();
                    conformance::$rule(&blank_backends(dir.path()));
                }
            )*
            /// Every rule in the suite is run here (a rule added to `conformance::RULES` but not
            /// listed above still runs).
            #[test]
            fn conformance_run_all() {
                let dir = tempfile::tempdir().unwrap();
                conformance::run_all(&blank_backends(dir.path()));
            }
        };
    }

    conformance_tests!(
        token_spent_once,
        expired_token_refused_and_pruned_at_next_mint,
        failed_bootstrap_recorded_once_and_burns_its_token,
        sessions_and_heartbeats,
        events_deduped_by_id,
        states_move_only_forward,
        unreadable_event_refused,
        events_of_another_node_ignored,
        accept_with_error_fails_waiting_run,
        waiting_runs_for_one_node_oldest_first,
        fail_run_ends_only_active_runs,
        create_set_checks_its_runs_and_programs,
        retention_prunes_oldest_run_set_and_program,
        schema_version_mismatch_refused,
    );

    #[test]
    fn reopened_store_keeps_its_records() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("coordinator.redb");
        let open = || Store::open(Box::new(RedbBackend::open(&path).unwrap()), 10).unwrap();
        let token = TokenRecord {
            expires_at_ms: 1_000,
            name: None,
            labels: Default::default(),
            spent_by: None,
            bootstrap_failure: None,
        };
        open().add_token("h", &token, 0).unwrap();
        let store = open();
        assert!(store.has_waiting_token(10).unwrap());
        assert!(matches!(
            RedbBackend::open(&path),
            Err(StoreError::Locked(locked)) if locked == path
        ));
    }

    #[test]
    fn another_version_on_disk_refused_with_both_versions() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("coordinator.redb");
        RedbBackend::open(&path)
            .unwrap()
            .create(SCHEMA_VERSION + 1)
            .unwrap();
        let before = std::fs::read(&path).unwrap();
        let err = Store::open(Box::new(RedbBackend::open(&path).unwrap()), 10)
            .err()
            .expect("refused");
        conformance::assert_newer_schema_refused(&err.to_string(), &path.display().to_string());
        assert_eq!(std::fs::read(&path).unwrap(), before, "left as it was");
    }

    #[test]
    fn foreign_redb_file_refused_not_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("other.redb");
        {
            let db = Database::create(&path).unwrap();
            let tx = db.begin_write().unwrap();
            const OTHER: TableDefinition<&str, u64> = TableDefinition::new("something");
            tx.open_table(OTHER).unwrap().insert("x", 1).unwrap();
            tx.commit().unwrap();
        }
        let before = std::fs::read(&path).unwrap();
        let err = Store::open(Box::new(RedbBackend::open(&path).unwrap()), 10)
            .err()
            .expect("refused");
        assert!(
            matches!(&err, StoreError::Schema { found: None, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("not a coordinator store"), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), before, "left as it was");
    }

    #[test]
    fn file_that_is_not_redb_refused_not_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("coordinator.redb");
        std::fs::write(&path, b"not a database, but somebody's notes\n").unwrap();
        let err = RedbBackend::open(&path).err().expect("refused");
        assert!(matches!(err, StoreError::Open { .. }), "{err}");
        assert_eq!(
            std::fs::read(&path).unwrap(),
            b"not a database, but somebody's notes\n"
        );
    }
}
