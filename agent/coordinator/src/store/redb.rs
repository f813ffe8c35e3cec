//! The embedded backend: one redb file, one table per record kind, records as JSON.
use super::{
    ActiveRun, Backend, Beat, FleetEntry, Layout, NodeRecord, ReadTx, RunRow, StoreError,
    StoreResult, TokenRecord, WriteTx, stored_run_id,
};
use fleet_proto::{Digest, NodeId, RunId, SetId};
use redb::{Database, ReadableTable, TableDefinition, TableHandle};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// sha256(token) hex -> TokenRecord JSON.
const TOKENS: TableDefinition<&str, &[u8]> = TableDefinition::new("tokens");
/// node id -> NodeRecord JSON (its heartbeat and lease are in LEASES).
const NODES: TableDefinition<&str, &[u8]> = TableDefinition::new("nodes");
/// node id -> (last heartbeat, lease until): what a heartbeat writes, apart from the record.
const LEASES: TableDefinition<&str, (Option<u64>, u64)> = TableDefinition::new("leases");
/// content digest (program or input) -> how many references stored runs hold on it.
const PROGRAM_REFS: TableDefinition<&str, u64> = TableDefinition::new("program_refs");
/// run id -> RunRow JSON.
const RUNS: TableDefinition<&str, &[u8]> = TableDefinition::new("runs");
/// set id -> JSON list of its run ids.
const SETS: TableDefinition<&str, &[u8]> = TableDefinition::new("sets");
/// Runs not yet final, by (node id, run id).
const ACTIVE: TableDefinition<(&str, &str), ()> = TableDefinition::new("active_by_node");
/// Runs their node has not taken yet, by (node id, run id).
const WAITING: TableDefinition<(&str, &str), ()> = TableDefinition::new("waiting_by_node");
/// Each node's final runs in the order they ended: (node id, sequence number) -> run id.
const FINAL: TableDefinition<(&str, u64), &str> = TableDefinition::new("final_by_node");
/// node id -> how many runs FINAL holds for it.
const FINAL_COUNTS: TableDefinition<&str, u64> = TableDefinition::new("final_counts");
/// node id -> the highest event id stored from it (apart from the record).
const EVENT_MARKS: TableDefinition<&str, u64> = TableDefinition::new("event_marks");
/// Coordinator address -> when it last said it serves this store.
const COORDINATORS: TableDefinition<&str, u64> = TableDefinition::new("coordinators");
/// `public_key` -> the fleet's public key (schema 3).
const FLEET: TableDefinition<&str, &str> = TableDefinition::new("fleet");
/// `schema_version`, and `final_seq` (the last sequence number given in FINAL).
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");

/// Schema 1's tables, read once by the upgrade to 2 and then deleted.
mod v1 {
    use redb::TableDefinition;
    /// program digest -> its bytes (content moved to the blob store on disk).
    pub const PROGRAMS: TableDefinition<&str, &[u8]> = TableDefinition::new("programs");
    /// run id -> node id.
    pub const ACTIVE: TableDefinition<&str, &str> = TableDefinition::new("active_runs");
    /// One order for the whole fleet: sequence number -> run id.
    pub const FINAL: TableDefinition<u64, &str> = TableDefinition::new("final_runs");
}

const SCHEMA_KEY: &str = "schema_version";
const FINAL_SEQ_KEY: &str = "final_seq";
const NODE_ENDS_KEY: &str = "node_ends";

/// One redb file. It holds no rules: see [`super::Store`].
pub struct RedbBackend {
    db: Database,
    path: PathBuf,
}

/// redb's page cache (its default is 1 GiB): pages past it are read again through the kernel's
/// page cache. Bounded, so the cache alone can never take a gigabyte of a coordinator that
/// stores many runs.
const CACHE_BYTES: usize = 64 << 20;

fn fail<E: Into<redb::Error>>(e: E) -> StoreError {
    StoreError::Db(e.into().to_string())
}

impl RedbBackend {
    /// Opens the file, or makes an empty one where there is none. A file that is not a redb
    /// database is refused as it is; what the database holds is judged by [`super::Store::open`].
    pub fn open(path: &Path) -> StoreResult<RedbBackend> {
        let mut builder = redb::Builder::new();
        let db = builder
            .set_cache_size(CACHE_BYTES)
            .create(path)
            .map_err(|e| match e {
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
    fn kind(&self) -> &'static str {
        "redb"
    }

    fn parallel_calls(&self) -> usize {
        // Reads are CPU work on pages in memory; the commit has its own thread.
        std::thread::available_parallelism().map_or(2, |n| n.get()) * 2
    }

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
        tx.open_table(LEASES).map_err(fail)?;
        tx.open_table(PROGRAM_REFS).map_err(fail)?;
        tx.open_table(RUNS).map_err(fail)?;
        tx.open_table(SETS).map_err(fail)?;
        tx.open_table(ACTIVE).map_err(fail)?;
        tx.open_table(WAITING).map_err(fail)?;
        tx.open_table(FINAL).map_err(fail)?;
        tx.open_table(FINAL_COUNTS).map_err(fail)?;
        tx.open_table(COORDINATORS).map_err(fail)?;
        tx.open_table(EVENT_MARKS).map_err(fail)?;
        tx.open_table(FLEET).map_err(fail)?;
        tx.open_table(META)
            .map_err(fail)?
            .insert(SCHEMA_KEY, version)
            .map_err(fail)?;
        tx.commit().map_err(fail)
    }

    fn upgrade(&self, from: u64, to: u64) -> StoreResult<()> {
        if !matches!((from, to), (1..=3, 4)) {
            return Err(StoreError::Db(format!(
                "no upgrade from schema {from} to {to}"
            )));
        }
        let mut tx = RedbWrite {
            tx: self.db.begin_write().map_err(fail)?,
        };
        if from == 1 {
            upgrade_1_to_2(&mut tx)?;
        }
        // 2 -> 3: the fleet's public key. 3 -> 4 changed only PostgreSQL's layout.
        tx.tx.open_table(FLEET).map_err(fail)?;
        tx.tx
            .open_table(META)
            .map_err(fail)?
            .insert(SCHEMA_KEY, to)
            .map_err(fail)?;
        tx.tx.commit().map_err(fail)
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
    // Cannot fail: records are plain data with string keys, which always serialize.
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
/// Schema 1 -> 2: the fleet-wide active and final orders become per-node indexes, runs not yet
/// taken get a waiting index, leases move out of the node records, the emptied programs table
/// goes.
fn upgrade_1_to_2(tx: &mut RedbWrite) -> StoreResult<()> {
    let mut active = Vec::new();
    for entry in tx
        .tx
        .open_table(v1::ACTIVE)
        .map_err(fail)?
        .iter()
        .map_err(fail)?
    {
        let (run, node) = entry.map_err(fail)?;
        active.push((stored_run_id(run.value())?, NodeId::new(node.value())));
    }
    let mut ended = Vec::new();
    for entry in tx
        .tx
        .open_table(v1::FINAL)
        .map_err(fail)?
        .iter()
        .map_err(fail)?
    {
        ended.push(stored_run_id(entry.map_err(fail)?.1.value())?);
    }
    for (run_id, node_id) in &active {
        tx.put_active(run_id, node_id)?;
        if tx.run(run_id)?.is_some_and(|r| !r.accepted) {
            tx.put_waiting(run_id, node_id)?;
        }
    }
    for run_id in &ended {
        if let Some(run) = tx.run(run_id)? {
            tx.push_final(run_id, &run.node_id)?;
        }
    }
    let nodes = all_json::<NodeRecord>(&tx.tx.open_table(NODES).map_err(fail)?)?;
    for (id, node) in nodes {
        tx.set_last_event_id(&node.id, node.last_event_id)?;
        let lease = (node.last_heartbeat_ms, node.lease_until_ms);
        tx.tx
            .open_table(LEASES)
            .map_err(fail)?
            .insert(id.as_str(), lease)
            .map_err(fail)?;
    }
    tx.tx.delete_table(v1::ACTIVE).map_err(fail)?;
    tx.tx.delete_table(v1::FINAL).map_err(fail)?;
    tx.tx.delete_table(v1::PROGRAMS).map_err(fail)?;
    tx.tx.open_table(WAITING).map_err(fail)?;
    tx.tx.open_table(FINAL_COUNTS).map_err(fail)?;
    tx.tx.open_table(COORDINATORS).map_err(fail)?;
    Ok(())
}

macro_rules! reads {
    ($ty:ty) => {
        impl ReadTx for $ty {
            fn token(&self, hash: &str) -> StoreResult<Option<TokenRecord>> {
                get_json(&self.tx.open_table(TOKENS).map_err(fail)?, hash)
            }

            fn tokens(&self) -> StoreResult<Vec<(String, TokenRecord)>> {
                all_json(&self.tx.open_table(TOKENS).map_err(fail)?)
            }

            fn node(&self, id: &NodeId) -> StoreResult<Option<NodeRecord>> {
                let leases = self.tx.open_table(LEASES).map_err(fail)?;
                let marks = self.tx.open_table(EVENT_MARKS).map_err(fail)?;
                let node = get_json(&self.tx.open_table(NODES).map_err(fail)?, id.as_str())?;
                node.map(|node| with_lease(&leases, &marks, node))
                    .transpose()
            }

            fn nodes(&self) -> StoreResult<Vec<NodeRecord>> {
                let leases = self.tx.open_table(LEASES).map_err(fail)?;
                let marks = self.tx.open_table(EVENT_MARKS).map_err(fail)?;
                let nodes = all_json(&self.tx.open_table(NODES).map_err(fail)?)?;
                nodes
                    .into_iter()
                    .map(|(_, node)| with_lease(&leases, &marks, node))
                    .collect()
            }

            fn referenced_content(&self) -> StoreResult<Vec<Digest>> {
                let refs = self.tx.open_table(PROGRAM_REFS).map_err(fail)?;
                let mut digests = Vec::new();
                for entry in refs.iter().map_err(fail)? {
                    let (digest, refs) = entry.map_err(fail)?;
                    if refs.value() > 0 {
                        digests.push(super::stored_digest(digest.value())?);
                    }
                }
                Ok(digests)
            }

            fn program_refs(&self, digest: &Digest) -> StoreResult<u64> {
                let refs = self.tx.open_table(PROGRAM_REFS).map_err(fail)?;
                let key = digest.to_string();
                Ok(refs
                    .get(key.as_str())
                    .map_err(fail)?
                    .map_or(0, |v| v.value()))
            }

            fn run(&self, id: &RunId) -> StoreResult<Option<RunRow>> {
                get_json(&self.tx.open_table(RUNS).map_err(fail)?, id.as_str())
            }

            fn set(&self, id: &SetId) -> StoreResult<Option<Vec<RunId>>> {
                get_json(&self.tx.open_table(SETS).map_err(fail)?, id.as_str())
            }

            fn active(&self, node_id: Option<&NodeId>) -> StoreResult<Vec<RunId>> {
                let active = self.tx.open_table(ACTIVE).map_err(fail)?;
                match node_id {
                    Some(node) => runs_under(&active, node),
                    None => {
                        let mut out = Vec::new();
                        for entry in active.iter().map_err(fail)? {
                            out.push(stored_run_id(entry.map_err(fail)?.0.value().1)?);
                        }
                        Ok(out)
                    }
                }
            }

            fn active_brief(&self) -> StoreResult<Vec<ActiveRun>> {
                let runs = self.tx.open_table(RUNS).map_err(fail)?;
                let mut out = Vec::new();
                for id in self.active(None)? {
                    if let Some(run) = get_json::<ActiveRun>(&runs, id.as_str())? {
                        out.push(run);
                    }
                }
                Ok(out)
            }

            fn waiting(&self, node_id: &NodeId) -> StoreResult<Vec<RunId>> {
                runs_under(&self.tx.open_table(WAITING).map_err(fail)?, node_id)
            }

            fn holds_active(&self, node_id: &NodeId) -> StoreResult<bool> {
                let active = self.tx.open_table(ACTIVE).map_err(fail)?;
                let first = active.range((node_id.as_str(), "")..).map_err(fail)?.next();
                match first {
                    Some(entry) => Ok(entry.map_err(fail)?.0.value().0 == node_id.as_str()),
                    None => Ok(false),
                }
            }

            fn active_counts(&self) -> StoreResult<BTreeMap<NodeId, u64>> {
                let active = self.tx.open_table(ACTIVE).map_err(fail)?;
                let mut counts: BTreeMap<NodeId, u64> = BTreeMap::new();
                for entry in active.iter().map_err(fail)? {
                    let (key, _) = entry.map_err(fail)?;
                    *counts.entry(NodeId::new(key.value().0)).or_default() += 1;
                }
                Ok(counts)
            }

            fn waiting_nodes(&self) -> StoreResult<Vec<NodeId>> {
                let waiting = self.tx.open_table(WAITING).map_err(fail)?;
                let mut out: Vec<NodeId> = Vec::new();
                for entry in waiting.iter().map_err(fail)? {
                    let (key, _) = entry.map_err(fail)?;
                    let node = key.value().0;
                    if out.last().is_none_or(|last| last.as_str() != node) {
                        out.push(NodeId::new(node));
                    }
                }
                Ok(out)
            }

            fn final_count(&self, node_id: &NodeId) -> StoreResult<u64> {
                let counts = self.tx.open_table(FINAL_COUNTS).map_err(fail)?;
                Ok(counts
                    .get(node_id.as_str())
                    .map_err(fail)?
                    .map_or(0, |v| v.value()))
            }

            fn coordinators(&self) -> StoreResult<Vec<(String, u64)>> {
                let table = self.tx.open_table(COORDINATORS).map_err(fail)?;
                let mut out = Vec::new();
                for entry in table.iter().map_err(fail)? {
                    let (address, seen) = entry.map_err(fail)?;
                    out.push((address.value().to_string(), seen.value()));
                }
                Ok(out)
            }

            fn node_changes(&self) -> StoreResult<u64> {
                let meta = self.tx.open_table(META).map_err(fail)?;
                Ok(meta
                    .get(NODE_ENDS_KEY)
                    .map_err(fail)?
                    .map_or(0, |v| v.value()))
            }

            fn fleet_entry(&self, entry: FleetEntry) -> StoreResult<Option<String>> {
                let fleet = self.tx.open_table(FLEET).map_err(fail)?;
                let value = fleet.get(entry.key()).map_err(fail)?;
                Ok(value.map(|v| v.value().to_string()))
            }
        }
    };
}

reads!(RedbRead);
reads!(RedbWrite);

/// The node's record with its heartbeat and lease as LEASES has them, and its last event id as
/// EVENT_MARKS has it.
fn with_lease(
    leases: &impl ReadableTable<&'static str, (Option<u64>, u64)>,
    marks: &impl ReadableTable<&'static str, u64>,
    mut node: NodeRecord,
) -> StoreResult<NodeRecord> {
    if let Some(lease) = leases.get(node.id.as_str()).map_err(fail)? {
        (node.last_heartbeat_ms, node.lease_until_ms) = lease.value();
    }
    node.last_event_id = marks
        .get(node.id.as_str())
        .map_err(fail)?
        .map_or(0, |v| v.value());
    Ok(node)
}

/// A run's key in an index keyed by (node id, run id).
fn index_key<'a>(run_id: &'a RunId, node_id: &'a NodeId) -> (&'a str, &'a str) {
    (node_id.as_str(), run_id.as_str())
}

/// The run ids under one node in an index keyed by (node id, run id), read by that key.
fn runs_under(
    index: &impl ReadableTable<(&'static str, &'static str), ()>,
    node_id: &NodeId,
) -> StoreResult<Vec<RunId>> {
    let mut out = Vec::new();
    for entry in index.range((node_id.as_str(), "")..).map_err(fail)? {
        let (key, _) = entry.map_err(fail)?;
        let (node, run) = key.value();
        if node != node_id.as_str() {
            break;
        }
        out.push(stored_run_id(run)?);
    }
    Ok(out)
}

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

    fn put_lease(
        &mut self,
        node_id: &NodeId,
        heard_ms: Option<u64>,
        lease_until_ms: u64,
    ) -> StoreResult<()> {
        let mut leases = self.tx.open_table(LEASES).map_err(fail)?;
        let (heard, until) = match leases.get(node_id.as_str()).map_err(fail)? {
            Some(was) => {
                let (was_heard, was_until) = was.value();
                (heard_ms.max(was_heard), lease_until_ms.max(was_until))
            }
            None => (heard_ms, lease_until_ms),
        };
        (leases.insert(node_id.as_str(), (heard, until)))
            .map_err(fail)
            .map(drop)
    }

    fn set_last_event_id(&mut self, node_id: &NodeId, id: u64) -> StoreResult<()> {
        let mut marks = self.tx.open_table(EVENT_MARKS).map_err(fail)?;
        marks.insert(node_id.as_str(), id).map_err(fail).map(drop)
    }

    fn touch_nodes(&mut self, beats: &[Beat]) -> StoreResult<Vec<Beat>> {
        let nodes = self.tx.open_table(NODES).map_err(fail)?;
        let mut leases = self.tx.open_table(LEASES).map_err(fail)?;
        for beat in beats {
            if nodes.get(beat.node_id.as_str()).map_err(fail)?.is_none() {
                continue;
            }
            let was = leases.get(beat.node_id.as_str()).map_err(fail)?;
            let (heard, until) = was.map_or((None, 0), |was| was.value());
            let lease = (beat.at_ms.max(heard), beat.lease_until_ms.max(until));
            leases.insert(beat.node_id.as_str(), lease).map_err(fail)?;
        }
        // One writer at a time: no row is ever busy.
        Ok(Vec::new())
    }

    fn set_program_refs(&mut self, digest: &Digest, refs: u64) -> StoreResult<()> {
        let mut table = self.tx.open_table(PROGRAM_REFS).map_err(fail)?;
        let key = digest.to_string();
        table.insert(key.as_str(), refs).map_err(fail).map(drop)
    }

    fn remove_program(&mut self, digest: &Digest) -> StoreResult<()> {
        let mut refs = self.tx.open_table(PROGRAM_REFS).map_err(fail)?;
        let key = digest.to_string();
        refs.remove(key.as_str()).map_err(fail).map(drop)
    }

    fn put_run(&mut self, run: &RunRow) -> StoreResult<()> {
        let mut runs = self.tx.open_table(RUNS).map_err(fail)?;
        runs.insert(run.id.as_str(), encode(run).as_slice())
            .map_err(fail)
            .map(drop)
    }

    fn remove_run(&mut self, id: &RunId) -> StoreResult<()> {
        let mut runs = self.tx.open_table(RUNS).map_err(fail)?;
        runs.remove(id.as_str()).map_err(fail).map(drop)
    }

    fn put_set(&mut self, id: &SetId, run_ids: &[RunId]) -> StoreResult<()> {
        let mut sets = self.tx.open_table(SETS).map_err(fail)?;
        sets.insert(id.as_str(), encode(&run_ids).as_slice())
            .map_err(fail)
            .map(drop)
    }

    fn remove_set(&mut self, id: &SetId) -> StoreResult<()> {
        let mut sets = self.tx.open_table(SETS).map_err(fail)?;
        sets.remove(id.as_str()).map_err(fail).map(drop)
    }

    fn put_active(&mut self, run_id: &RunId, node_id: &NodeId) -> StoreResult<()> {
        let mut active = self.tx.open_table(ACTIVE).map_err(fail)?;
        active
            .insert(index_key(run_id, node_id), ())
            .map_err(fail)
            .map(drop)
    }

    fn remove_active(&mut self, run_id: &RunId, node_id: &NodeId) -> StoreResult<()> {
        let mut active = self.tx.open_table(ACTIVE).map_err(fail)?;
        active
            .remove(index_key(run_id, node_id))
            .map_err(fail)
            .map(drop)
    }

    fn put_waiting(&mut self, run_id: &RunId, node_id: &NodeId) -> StoreResult<()> {
        let mut waiting = self.tx.open_table(WAITING).map_err(fail)?;
        waiting
            .insert(index_key(run_id, node_id), ())
            .map_err(fail)
            .map(drop)
    }

    fn remove_waiting(&mut self, run_id: &RunId, node_id: &NodeId) -> StoreResult<()> {
        let mut waiting = self.tx.open_table(WAITING).map_err(fail)?;
        waiting
            .remove(index_key(run_id, node_id))
            .map_err(fail)
            .map(drop)
    }

    fn push_final(&mut self, run_id: &RunId, node_id: &NodeId) -> StoreResult<()> {
        let mut meta = self.tx.open_table(META).map_err(fail)?;
        let seq = meta
            .get(FINAL_SEQ_KEY)
            .map_err(fail)?
            .map_or(0, |v| v.value())
            + 1;
        meta.insert(FINAL_SEQ_KEY, seq).map_err(fail)?;
        let mut order = self.tx.open_table(FINAL).map_err(fail)?;
        (order.insert((node_id.as_str(), seq), run_id.as_str())).map_err(fail)?;
        drop((meta, order));
        self.add_final_count(node_id, 1)
    }

    fn pop_final(&mut self, node_id: &NodeId) -> StoreResult<Option<RunId>> {
        let node = node_id.as_str();
        let mut order = self.tx.open_table(FINAL).map_err(fail)?;
        let oldest = order
            .range((node, 0)..=(node, u64::MAX))
            .map_err(fail)?
            .next()
            .transpose()
            .map_err(fail)?
            .map(|(key, run)| (key.value().1, run.value().to_string()));
        let Some((seq, run_id)) = oldest else {
            return Ok(None);
        };
        order.remove((node, seq)).map_err(fail)?;
        drop(order);
        self.add_final_count(node_id, -1)?;
        stored_run_id(&run_id).map(Some)
    }

    fn put_coordinator(&mut self, address: &str, seen_ms: u64) -> StoreResult<()> {
        let mut table = self.tx.open_table(COORDINATORS).map_err(fail)?;
        table.insert(address, seen_ms).map_err(fail).map(drop)
    }

    fn count_node_change(&mut self) -> StoreResult<()> {
        let ends = self.node_changes()? + 1;
        let mut meta = self.tx.open_table(META).map_err(fail)?;
        meta.insert(NODE_ENDS_KEY, ends).map_err(fail).map(drop)
    }

    fn set_fleet_entry(&mut self, entry: FleetEntry, value: &str) -> StoreResult<()> {
        let mut fleet = self.tx.open_table(FLEET).map_err(fail)?;
        fleet.insert(entry.key(), value).map_err(fail).map(drop)
    }

    fn remove_node(&mut self, id: &NodeId) -> StoreResult<()> {
        let mut nodes = self.tx.open_table(NODES).map_err(fail)?;
        nodes.remove(id.as_str()).map_err(fail)?;
        let mut leases = self.tx.open_table(LEASES).map_err(fail)?;
        leases.remove(id.as_str()).map_err(fail)?;
        let mut marks = self.tx.open_table(EVENT_MARKS).map_err(fail)?;
        marks.remove(id.as_str()).map_err(fail).map(drop)
    }
}

impl RedbWrite {
    fn add_final_count(&mut self, node_id: &NodeId, by: i64) -> StoreResult<()> {
        let node = node_id.as_str();
        let mut counts = self.tx.open_table(FINAL_COUNTS).map_err(fail)?;
        let count = counts.get(node).map_err(fail)?.map_or(0, |v| v.value());
        match count.saturating_add_signed(by) {
            0 => counts.remove(node).map_err(fail).map(drop),
            count => counts.insert(node, count).map_err(fail).map(drop),
        }
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
        the_first_key_is_the_fleets,
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
        a_lost_verdict_spares_a_node_heard_since,
        create_set_checks_its_runs_and_programs,
        retention_prunes_oldest_run_set_and_program,
        schema_version_mismatch_refused,
        retention_is_per_node,
        waiting_index_follows_the_runs,
        changes_applied_together_each_answered,
        a_drain_is_kept_and_refuses_new_runs,
        a_capacity_is_kept_and_runs_go_out_in_order,
        ending_a_node_loses_its_runs_and_forget_removes_it,
        a_lost_run_with_retries_is_placed_again_once,
        runs_queued_for_a_match_go_to_distinct_matching_nodes,
    );

    /// A store written by schema 1 (one fleet-wide active and final order, leases in the node
    /// records, the programs table) opens upgraded, with every record where schema 2 keeps it.
    #[test]
    fn schema_1_store_upgraded_at_open() {
        use fleet_proto::run::RunState;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("coordinator.redb");
        let node: NodeRecord = serde_json::from_value(serde_json::json!({
            "id": "n-a", "public_key": "ed25519:a", "name": null, "facts": null,
            "joined_at_ms": 1, "last_heartbeat_ms": 7, "lease_until_ms": 9, "generation": 3,
            "last_event_id": 5
        }))
        .unwrap();
        let waiting = conformance::run("r-wait", "s", "n-a", b"p", 1);
        let mut taken = conformance::run("r-taken", "s", "n-a", b"p", 2);
        taken.accepted = true;
        let mut ended = conformance::run("r-ended", "s", "n-a", b"p", 3);
        ended.state = RunState::Finished;
        {
            let db = Database::create(&path).unwrap();
            let tx = db.begin_write().unwrap();
            let mut meta = tx.open_table(META).unwrap();
            meta.insert(SCHEMA_KEY, 1).unwrap();
            meta.insert(FINAL_SEQ_KEY, 1).unwrap();
            let mut nodes = tx.open_table(NODES).unwrap();
            nodes.insert("n-a", encode(&node).as_slice()).unwrap();
            let mut runs = tx.open_table(RUNS).unwrap();
            for run in [&waiting, &taken, &ended] {
                runs.insert(run.id.as_str(), encode(run).as_slice())
                    .unwrap();
            }
            let mut active = tx.open_table(v1::ACTIVE).unwrap();
            active.insert("r-wait", "n-a").unwrap();
            active.insert("r-taken", "n-a").unwrap();
            let mut ended_order = tx.open_table(v1::FINAL).unwrap();
            ended_order.insert(1, "r-ended").unwrap();
            tx.open_table(v1::PROGRAMS).unwrap();
            drop((meta, nodes, runs, active, ended_order));
            tx.commit().unwrap();
        }
        let store = Store::open(Box::new(RedbBackend::open(&path).unwrap()), 10).unwrap();
        // Schema 3's table is there: the first key is recorded.
        assert_eq!(store.claim_fleet_key("ed25519:k").unwrap(), "ed25519:k");
        let waiting_ids: Vec<RunId> = (store.waiting_runs(&"n-a".into()).unwrap())
            .into_iter()
            .map(|r| r.id)
            .collect();
        assert_eq!(waiting_ids, ["r-wait"]);
        let mut active: Vec<RunId> = (store.active_runs().unwrap())
            .into_iter()
            .map(|r| r.id)
            .collect();
        active.sort();
        assert_eq!(active, ["r-taken", "r-wait"]);
        assert_eq!(store.read(|tx| tx.final_count(&"n-a".into())).unwrap(), 1);
        let upgraded = store.node(&"n-a".into()).unwrap().unwrap();
        assert_eq!(
            (
                upgraded.last_heartbeat_ms,
                upgraded.lease_until_ms,
                upgraded.generation,
                upgraded.last_event_id
            ),
            (Some(7), 9, 3, 5)
        );
        drop(store);
        let reopened = RedbBackend::open(&path).unwrap();
        assert_eq!(reopened.layout().unwrap(), Layout::Version(SCHEMA_VERSION));
    }

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
