//! The coordinator's durable state behind a narrow trait (`CoordinatorStore`), so a hub can put
//! PostgreSQL behind it later; the embedded default is redb. Tokens are kept only as hashes.
use fleet_proto::facts::Facts;
use fleet_proto::fsutil::now_ms;
use fleet_proto::run::{Event, RunOptions, RunReport, RunState, Workload};
use redb::{Database, ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// sha256(token) hex -> TokenRecord JSON.
const TOKENS: TableDefinition<&str, &[u8]> = TableDefinition::new("tokens");
/// node id -> NodeRecord JSON.
const NODES: TableDefinition<&str, &[u8]> = TableDefinition::new("nodes");
/// program digest -> its bytes, to stage on nodes that have not got it.
const PROGRAMS: TableDefinition<&str, &[u8]> = TableDefinition::new("programs");
/// run id -> RunRow JSON.
const RUNS: TableDefinition<&str, &[u8]> = TableDefinition::new("runs");
/// set id -> JSON list of its run ids.
const SETS: TableDefinition<&str, &[u8]> = TableDefinition::new("sets");
/// Runs not yet final: run id -> node id.
const ACTIVE: TableDefinition<&str, &str> = TableDefinition::new("active_runs");
/// Final runs in the order they ended, so the oldest beyond the retention go first.
const FINAL: TableDefinition<u64, &str> = TableDefinition::new("final_runs");
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");

/// The newest this many final runs are kept.
pub const KEEP_FINAL_RUNS: u64 = 1000;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TokenRecord {
    pub expires_at_ms: u64,
    pub name: Option<String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// The key (`ed25519:...`) that spent the token; only that key is answered again.
    pub spent_by: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeRecord {
    pub id: String,
    pub public_key: String,
    pub name: Option<String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    pub facts: Option<Facts>,
    pub joined_at_ms: u64,
    pub last_heartbeat_ms: Option<u64>,
    /// The node counts as `Joined` until then, `lost` after.
    pub lease_until_ms: u64,
    /// The fencing token of the node's newest session.
    pub generation: u64,
    /// The highest event id stored from this node; anything at or below it is a duplicate.
    #[serde(default)]
    pub last_event_id: u64,
}

/// One run on one node, as the coordinator records it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunRow {
    pub id: String,
    pub set_id: String,
    pub node_id: String,
    pub state: RunState,
    pub workload: Workload,
    #[serde(flatten)]
    pub options: RunOptions,
    pub created_ms: u64,
    pub updated_ms: u64,
    /// The node answered the start (the run is its now, whatever happens next).
    pub accepted: bool,
    /// What the node reported with the final state: the outcome, and the runtime's record.
    pub report: Option<RunReport>,
    /// Why the run failed or was lost, or why an event about it was refused.
    pub error: Option<String>,
    /// Each event stored once, by id.
    pub events: Vec<EventRecord>,
    /// Sent as-is in place of the start (see [`super::runs::RunRequest::raw_command`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub raw_command: Option<serde_json::Value>,
}

/// One event as stored on its run: its state, or why it was refused.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EventRecord {
    pub id: u64,
    pub state: Option<RunState>,
    /// At the node, by the node's clock.
    pub at_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused: Option<String>,
}

/// An event as it came from a node: one this coordinator understands, or one it cannot read
/// (a state from a newer agent), which is stored as refused with its reason and never applied.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum NodeEvent {
    Known(Event),
    Unreadable {
        id: u64,
        run_id: String,
        at_ms: u64,
        reason: String,
    },
}

impl NodeEvent {
    pub fn id(&self) -> u64 {
        match self {
            NodeEvent::Known(e) => e.id,
            NodeEvent::Unreadable { id, .. } => *id,
        }
    }

    pub fn run_id(&self) -> &str {
        match self {
            NodeEvent::Known(e) => &e.run_id,
            NodeEvent::Unreadable { run_id, .. } => run_id,
        }
    }
}

/// A join answered: the node, and whether this request spent the token (false: a retry).
#[derive(Debug, Clone)]
pub struct Redeemed {
    pub node: NodeRecord,
    pub first: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("the coordinator store {} is in use by another process: stop it, or run this command while `coordinator serve` is up so it goes through its socket", .0.display())]
    Locked(PathBuf),
    #[error("cannot open the coordinator store {}: {reason}", path.display())]
    Open { path: PathBuf, reason: String },
    #[error("the coordinator store failed: {0}")]
    Db(String),
    #[error("the coordinator store holds a corrupt record under {0}")]
    Corrupt(String),
}

fn fail<E: Into<redb::Error>>(e: E) -> StoreError {
    StoreError::Db(e.into().to_string())
}

pub type StoreResult<T> = Result<T, StoreError>;

/// Everything the coordinator remembers. Each method is one transaction.
pub trait CoordinatorStore: Send + Sync {
    fn add_token(&self, hash: &str, token: &TokenRecord) -> StoreResult<()>;
    /// Spends the token for `key` and records the node; answers again for the same key until the
    /// token expires; None for an unknown, expired, or foreign-spent token.
    fn redeem(
        &self,
        hash: &str,
        key: &str,
        node_id: &str,
        now_ms: u64,
        lease_until_ms: u64,
    ) -> StoreResult<Option<Redeemed>>;
    /// Whether some machine may still be waiting to join (an unexpired, unspent token exists).
    fn has_waiting_token(&self, now_ms: u64) -> StoreResult<bool>;
    fn node(&self, id: &str) -> StoreResult<Option<NodeRecord>>;
    fn nodes(&self) -> StoreResult<Vec<NodeRecord>>;
    /// Starts a session: a new, higher generation, and a fresh lease.
    fn open_session(&self, id: &str, lease_until_ms: u64) -> StoreResult<u64>;
    /// Records a heartbeat (and new facts, when given) and extends the lease.
    fn heartbeat(
        &self,
        id: &str,
        now_ms: u64,
        lease_until_ms: u64,
        facts: Option<Facts>,
    ) -> StoreResult<()>;
    fn put_program(&self, digest: &str, bytes: &[u8]) -> StoreResult<()>;
    fn program(&self, digest: &str) -> StoreResult<Option<Vec<u8>>>;
    /// Records a set and its runs (all `waiting`) in one transaction.
    fn create_set(&self, set_id: &str, runs: &[RunRow]) -> StoreResult<()>;
    /// The runs of a set, or None for an unknown set (or one pruned by the retention).
    fn set_runs(&self, set_id: &str) -> StoreResult<Option<Vec<RunRow>>>;
    fn run(&self, id: &str) -> StoreResult<Option<RunRow>>;
    /// Every run not yet final.
    fn active_runs(&self) -> StoreResult<Vec<RunRow>>;
    /// The runs waiting for `node_id` that it has not accepted yet, oldest first.
    fn waiting_runs(&self, node_id: &str) -> StoreResult<Vec<RunRow>>;
    /// Changes one run; a run becoming final leaves the active index and joins the retention.
    fn update_run(
        &self,
        id: &str,
        change: &mut dyn FnMut(&mut RunRow),
    ) -> StoreResult<Option<RunRow>>;
    /// Records the node's answers to starts, in one transaction: each run is the node's now;
    /// an error answer fails a run not yet final.
    fn accept_runs(&self, answers: &[(String, Option<String>)]) -> StoreResult<()>;
    /// Stores a node's events once each (dedupe by id) and applies them to their runs; returns
    /// the highest id stored from that node, which the node may forget up to.
    fn apply_events(&self, node_id: &str, events: &[NodeEvent]) -> StoreResult<u64>;
}

/// The embedded store: one redb file.
pub struct RedbStore {
    db: Database,
}

impl RedbStore {
    pub fn open(path: &Path) -> StoreResult<RedbStore> {
        let db = Database::create(path).map_err(|e| match e {
            redb::DatabaseError::DatabaseAlreadyOpen => StoreError::Locked(path.to_path_buf()),
            other => StoreError::Open {
                path: path.to_path_buf(),
                reason: other.to_string(),
            },
        })?;
        let tx = db.begin_write().map_err(fail)?;
        tx.open_table(TOKENS).map_err(fail)?;
        tx.open_table(NODES).map_err(fail)?;
        tx.open_table(PROGRAMS).map_err(fail)?;
        tx.open_table(RUNS).map_err(fail)?;
        tx.open_table(SETS).map_err(fail)?;
        tx.open_table(ACTIVE).map_err(fail)?;
        tx.open_table(FINAL).map_err(fail)?;
        tx.open_table(META).map_err(fail)?;
        tx.commit().map_err(fail)?;
        Ok(RedbStore { db })
    }
}

fn decode<T: serde::de::DeserializeOwned>(key: &str, bytes: &[u8]) -> StoreResult<T> {
    serde_json::from_slice(bytes).map_err(|_| StoreError::Corrupt(key.to_string()))
}

fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec(value).expect("records serialize")
}

type JsonTable = TableDefinition<'static, &'static str, &'static [u8]>;

/// The JSON record under `key`, or None when there is none.
fn get_record<T: serde::de::DeserializeOwned>(
    table: &impl ReadableTable<&'static str, &'static [u8]>,
    key: &str,
) -> StoreResult<Option<T>> {
    match table.get(key).map_err(fail)? {
        Some(v) => decode(key, v.value()).map(Some),
        None => Ok(None),
    }
}

/// A node that sends anything has joined, so a missing record means the store is damaged.
fn known_node(
    nodes: &impl ReadableTable<&'static str, &'static [u8]>,
    id: &str,
) -> StoreResult<NodeRecord> {
    get_record(nodes, id)?.ok_or_else(|| StoreError::Corrupt(format!("node {id} (missing)")))
}

impl CoordinatorStore for RedbStore {
    fn add_token(&self, hash: &str, token: &TokenRecord) -> StoreResult<()> {
        let tx = self.db.begin_write().map_err(fail)?;
        {
            let mut tokens = tx.open_table(TOKENS).map_err(fail)?;
            tokens
                .insert(hash, encode(token).as_slice())
                .map_err(fail)?;
        }
        tx.commit().map_err(fail)
    }

    fn redeem(
        &self,
        hash: &str,
        key: &str,
        node_id: &str,
        now_ms: u64,
        lease_until_ms: u64,
    ) -> StoreResult<Option<Redeemed>> {
        let tx = self.db.begin_write().map_err(fail)?;
        let answer = {
            let mut tokens = tx.open_table(TOKENS).map_err(fail)?;
            let mut nodes = tx.open_table(NODES).map_err(fail)?;
            let token: Option<TokenRecord> = get_record(&tokens, hash)?;
            match token {
                Some(mut token) if now_ms < token.expires_at_ms => {
                    match token.spent_by.as_deref() {
                        Some(spender) if spender != key => None,
                        Some(_) => {
                            get_record(&nodes, node_id)?.map(|node| Redeemed { node, first: false })
                        }
                        None => {
                            token.spent_by = Some(key.to_string());
                            tokens
                                .insert(hash, encode(&token).as_slice())
                                .map_err(fail)?;
                            let node = NodeRecord {
                                id: node_id.to_string(),
                                public_key: key.to_string(),
                                name: token.name.clone(),
                                labels: token.labels.clone(),
                                facts: None,
                                joined_at_ms: now_ms,
                                last_heartbeat_ms: None,
                                lease_until_ms,
                                generation: 0,
                                last_event_id: 0,
                            };
                            nodes
                                .insert(node_id, encode(&node).as_slice())
                                .map_err(fail)?;
                            Some(Redeemed { node, first: true })
                        }
                    }
                }
                _ => None,
            }
        };
        tx.commit().map_err(fail)?;
        Ok(answer)
    }

    fn has_waiting_token(&self, now_ms: u64) -> StoreResult<bool> {
        let tx = self.db.begin_read().map_err(fail)?;
        let tokens = tx.open_table(TOKENS).map_err(fail)?;
        for entry in tokens.iter().map_err(fail)? {
            let (k, v) = entry.map_err(fail)?;
            let token: TokenRecord = decode(k.value(), v.value())?;
            if token.spent_by.is_none() && now_ms < token.expires_at_ms {
                return Ok(true);
            }
        }
        Ok(false)
    }

    fn node(&self, id: &str) -> StoreResult<Option<NodeRecord>> {
        self.read_record(NODES, id)
    }

    fn nodes(&self) -> StoreResult<Vec<NodeRecord>> {
        let tx = self.db.begin_read().map_err(fail)?;
        let nodes = tx.open_table(NODES).map_err(fail)?;
        let mut out = Vec::new();
        for entry in nodes.iter().map_err(fail)? {
            let (k, v) = entry.map_err(fail)?;
            out.push(decode(k.value(), v.value())?);
        }
        Ok(out)
    }

    fn open_session(&self, id: &str, lease_until_ms: u64) -> StoreResult<u64> {
        self.update_node(id, |node| {
            node.generation += 1;
            node.lease_until_ms = lease_until_ms;
        })
        .map(|node| node.generation)
    }

    fn heartbeat(
        &self,
        id: &str,
        now_ms: u64,
        lease_until_ms: u64,
        facts: Option<Facts>,
    ) -> StoreResult<()> {
        self.update_node(id, |node| {
            node.last_heartbeat_ms = Some(now_ms);
            node.lease_until_ms = lease_until_ms;
            if let Some(facts) = facts {
                node.facts = Some(facts);
            }
        })
        .map(drop)
    }

    fn put_program(&self, digest: &str, bytes: &[u8]) -> StoreResult<()> {
        let tx = self.db.begin_write().map_err(fail)?;
        tx.open_table(PROGRAMS)
            .map_err(fail)?
            .insert(digest, bytes)
            .map_err(fail)?;
        tx.commit().map_err(fail)
    }

    fn program(&self, digest: &str) -> StoreResult<Option<Vec<u8>>> {
        let tx = self.db.begin_read().map_err(fail)?;
        let programs = tx.open_table(PROGRAMS).map_err(fail)?;
        Ok(programs
            .get(digest)
            .map_err(fail)?
            .map(|v| v.value().to_vec()))
    }

    fn create_set(&self, set_id: &str, runs: &[RunRow]) -> StoreResult<()> {
        let tx = self.db.begin_write().map_err(fail)?;
        {
            let mut table = tx.open_table(RUNS).map_err(fail)?;
            let mut active = tx.open_table(ACTIVE).map_err(fail)?;
            for run in runs {
                table
                    .insert(run.id.as_str(), encode(run).as_slice())
                    .map_err(fail)?;
                active
                    .insert(run.id.as_str(), run.node_id.as_str())
                    .map_err(fail)?;
            }
            let ids: Vec<&str> = runs.iter().map(|r| r.id.as_str()).collect();
            tx.open_table(SETS)
                .map_err(fail)?
                .insert(set_id, encode(&ids).as_slice())
                .map_err(fail)?;
        }
        tx.commit().map_err(fail)
    }

    fn set_runs(&self, set_id: &str) -> StoreResult<Option<Vec<RunRow>>> {
        let tx = self.db.begin_read().map_err(fail)?;
        let sets = tx.open_table(SETS).map_err(fail)?;
        let Some(ids) = sets.get(set_id).map_err(fail)? else {
            return Ok(None);
        };
        let ids: Vec<String> = decode(set_id, ids.value())?;
        let runs = tx.open_table(RUNS).map_err(fail)?;
        let mut out = Vec::new();
        for id in ids {
            out.extend(get_record(&runs, &id)?);
        }
        Ok(Some(out))
    }

    fn run(&self, id: &str) -> StoreResult<Option<RunRow>> {
        self.read_record(RUNS, id)
    }

    fn active_runs(&self) -> StoreResult<Vec<RunRow>> {
        let tx = self.db.begin_read().map_err(fail)?;
        let active = tx.open_table(ACTIVE).map_err(fail)?;
        let runs = tx.open_table(RUNS).map_err(fail)?;
        let mut out = Vec::new();
        for entry in active.iter().map_err(fail)? {
            let (id, _) = entry.map_err(fail)?;
            out.extend(get_record(&runs, id.value())?);
        }
        Ok(out)
    }

    fn waiting_runs(&self, node_id: &str) -> StoreResult<Vec<RunRow>> {
        let tx = self.db.begin_read().map_err(fail)?;
        let active = tx.open_table(ACTIVE).map_err(fail)?;
        let runs = tx.open_table(RUNS).map_err(fail)?;
        let mut out = Vec::new();
        for entry in active.iter().map_err(fail)? {
            let (id, node) = entry.map_err(fail)?;
            if node.value() != node_id {
                continue;
            }
            let row: Option<RunRow> = get_record(&runs, id.value())?;
            out.extend(row.filter(|r| !r.accepted));
        }
        out.sort_by_key(|r| r.created_ms);
        Ok(out)
    }

    fn update_run(
        &self,
        id: &str,
        change: &mut dyn FnMut(&mut RunRow),
    ) -> StoreResult<Option<RunRow>> {
        let tx = self.db.begin_write().map_err(fail)?;
        let row = change_run_in(&tx, id, change)?;
        tx.commit().map_err(fail)?;
        Ok(row)
    }

    fn accept_runs(&self, answers: &[(String, Option<String>)]) -> StoreResult<()> {
        let tx = self.db.begin_write().map_err(fail)?;
        for (id, error) in answers {
            change_run_in(&tx, id, &mut |r| {
                r.accepted = true;
                if let (Some(e), false) = (error, r.state.is_final()) {
                    r.state = RunState::Failed;
                    r.error = Some(e.clone());
                }
            })?;
        }
        tx.commit().map_err(fail)
    }

    fn apply_events(&self, node_id: &str, events: &[NodeEvent]) -> StoreResult<u64> {
        let tx = self.db.begin_write().map_err(fail)?;
        let last = {
            let mut nodes = tx.open_table(NODES).map_err(fail)?;
            let mut node = known_node(&nodes, node_id)?;
            let mut retired = Vec::new();
            {
                let mut runs = tx.open_table(RUNS).map_err(fail)?;
                for event in events {
                    if event.id() <= node.last_event_id {
                        continue;
                    }
                    node.last_event_id = event.id();
                    let row: Option<RunRow> = get_record(&runs, event.run_id())?;
                    let Some(mut row) = row.filter(|r| r.node_id == node_id) else {
                        continue;
                    };
                    if apply_event(&mut row, event) {
                        retired.push(row.id.clone());
                    }
                    row.updated_ms = now_ms();
                    runs.insert(row.id.as_str(), encode(&row).as_slice())
                        .map_err(fail)?;
                }
            }
            for id in retired {
                retire(&tx, &id)?;
            }
            nodes
                .insert(node_id, encode(&node).as_slice())
                .map_err(fail)?;
            node.last_event_id
        };
        tx.commit().map_err(fail)?;
        Ok(last)
    }
}

/// Records one event on its run and moves the run forward when the event allows; true when the
/// run became final.
fn apply_event(row: &mut RunRow, event: &NodeEvent) -> bool {
    let event = match event {
        NodeEvent::Known(event) => event,
        NodeEvent::Unreadable {
            id, at_ms, reason, ..
        } => {
            row.events.push(EventRecord {
                id: *id,
                state: None,
                at_ms: *at_ms,
                refused: Some(reason.clone()),
            });
            return false;
        }
    };
    row.events.push(EventRecord {
        id: event.id,
        state: Some(event.state),
        at_ms: event.at_unix_ms,
        refused: None,
    });
    if !row.state.may_become(event.state) {
        return false;
    }
    row.state = event.state;
    if !event.state.is_final() {
        return false;
    }
    if let Some(error) = &event.report.error {
        row.error = Some(error.clone());
    }
    row.report = Some(event.report.clone());
    true
}

/// Changes one run inside a transaction; a run becoming final is retired.
fn change_run_in(
    tx: &redb::WriteTransaction,
    id: &str,
    change: &mut dyn FnMut(&mut RunRow),
) -> StoreResult<Option<RunRow>> {
    let mut runs = tx.open_table(RUNS).map_err(fail)?;
    let row: Option<RunRow> = get_record(&runs, id)?;
    let Some(mut row) = row else {
        return Ok(None);
    };
    let was_final = row.state.is_final();
    change(&mut row);
    row.updated_ms = now_ms();
    runs.insert(id, encode(&row).as_slice()).map_err(fail)?;
    drop(runs);
    if !was_final && row.state.is_final() {
        retire(tx, id)?;
    }
    Ok(Some(row))
}

/// A run became final: out of the active index, into the retention order, oldest pruned.
fn retire(tx: &redb::WriteTransaction, id: &str) -> StoreResult<()> {
    use redb::ReadableTableMetadata;
    tx.open_table(ACTIVE)
        .map_err(fail)?
        .remove(id)
        .map_err(fail)?;
    let mut meta = tx.open_table(META).map_err(fail)?;
    let seq = meta
        .get("final_seq")
        .map_err(fail)?
        .map_or(0, |v| v.value())
        + 1;
    meta.insert("final_seq", seq).map_err(fail)?;
    let mut order = tx.open_table(FINAL).map_err(fail)?;
    order.insert(seq, id).map_err(fail)?;
    let mut runs = tx.open_table(RUNS).map_err(fail)?;
    while order.len().map_err(fail)? > KEEP_FINAL_RUNS {
        let Some((_, old)) = order.pop_first().map_err(fail)? else {
            break;
        };
        runs.remove(old.value()).map_err(fail)?;
    }
    Ok(())
}

impl RedbStore {
    /// One record, in a read transaction of its own.
    fn read_record<T: serde::de::DeserializeOwned>(
        &self,
        table: JsonTable,
        key: &str,
    ) -> StoreResult<Option<T>> {
        let tx = self.db.begin_read().map_err(fail)?;
        get_record(&tx.open_table(table).map_err(fail)?, key)
    }

    fn update_node(
        &self,
        id: &str,
        change: impl FnOnce(&mut NodeRecord),
    ) -> StoreResult<NodeRecord> {
        let tx = self.db.begin_write().map_err(fail)?;
        let node = {
            let mut nodes = tx.open_table(NODES).map_err(fail)?;
            let mut node = known_node(&nodes, id)?;
            change(&mut node);
            nodes.insert(id, encode(&node).as_slice()).map_err(fail)?;
            node
        };
        tx.commit().map_err(fail)?;
        Ok(node)
    }
}
