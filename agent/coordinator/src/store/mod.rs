//! The coordinator's durable state, in three layers:
//!
//! - [`Store`] (in `rules.rs`) is what the coordinator calls: one method per intent (redeem a
//!   token, take the runs waiting for a node, apply a node's events, fail a run, ...), each one
//!   transaction. The rules live there and only there: events deduped per node by id, states
//!   moving only forward, a final run retired into its node's retention order with that node's
//!   oldest pruned beyond [`Store::keep_final_runs`] (with its set once empty and its program
//!   once no kept run refers to it), expired tokens pruned at the next mint, and the schema
//!   version checked at open (an older one upgraded, a newer one refused). [`Store::apply`]
//!   applies many sessions' [`Change`]s in one transaction (group commit).
//! - [`Backend`] with [`ReadTx`] and [`WriteTx`] is what a database provides: typed records read
//!   and written inside one transaction, and nothing else. [`redb::RedbBackend`] is the embedded
//!   one, [`postgres::PostgresBackend`] the shared one.
//! - [`conformance`] holds one check per rule, run against any backend; every backend must pass
//!   all of them (`conformance::run_all`).
//!
//! Tokens are kept only as hashes.
use fleet_proto::facts::Facts;
use fleet_proto::protocol::NodeEnd;
use fleet_proto::run::{Event, RunOptions, RunReport, RunState, Workload};
use fleet_proto::version::{Incompatible, ProtocolVersion};
use fleet_proto::{Digest, NodeId, RunId, SetId};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Behind the `conformance` feature (and in unit tests): panicking checks, never shipped.
#[cfg(any(test, feature = "conformance"))]
pub mod conformance;
pub mod postgres;
pub mod redb;
mod rules;

pub use self::postgres::PostgresBackend;
pub use redb::RedbBackend;

pub use rules::{Applied, Change, EndOutcome, ForgetOutcome, ReleaseAdded, RunMoved};

/// The newest this many final runs of each node are kept by default, as a machine keeps its run
/// folders.
pub const KEEP_FINAL_RUNS: u64 = 1000;

/// The layout of the records this coordinator reads and writes; a store records the version it
/// was created with. An older store is upgraded at open; a newer one is refused.
///
/// 1: one retention order for the whole fleet; 2: retention per node, a waiting index per node,
/// and the lease apart from the node's record (a heartbeat writes only it); 3: the fleet's public
/// key; 4: on PostgreSQL, the lease in a table of its own (a heartbeat never updates the row a
/// transaction on the record writes).
pub const SCHEMA_VERSION: u64 = 4;

/// A lease as written: when the node was heard (None for a lease given without hearing it),
/// and until when it holds the node's lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Beat {
    pub node_id: NodeId,
    pub at_ms: Option<u64>,
    pub lease_until_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenRecord {
    pub expires_at_ms: u64,
    pub name: Option<String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// The key (`ed25519:...`) that spent the token; only that key is answered again.
    pub spent_by: Option<String>,
    /// The machine's bootstrap failed before it could join, and said why; the token is burnt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap_failure: Option<BootstrapFailure>,
}

/// A machine's report that its bootstrap failed (a bundle that did not match, a fetch that did
/// not work), recorded on the token it was handed, by the coordinator's clock.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BootstrapFailure {
    pub at_ms: u64,
    pub reason: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeRecord {
    pub id: NodeId,
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
    /// Kept apart from the record ([`WriteTx::set_last_event_id`]): storing events never writes
    /// the node's row, which heartbeats write every second.
    #[serde(default)]
    pub last_event_id: u64,
    /// The coordinator (its advertised `host:port`) that opened the node's newest session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_at: Option<String>,
    /// Since when the node takes no new run (`fleet-coordinator drain`); it finishes what it holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drained_since_ms: Option<u64>,
    /// The operator's limit on runs at once (`fleet-coordinator capacity`), under the agent's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<u32>,
    /// Set once the operator retired or revoked the node: its key is refused from then on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended: Option<Ending>,
    /// When its last run not final ended (what a pool loop reads to choose whom to drain).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_since_ms: Option<u64>,
    /// The protocol version of its newest session, or why its last hello was refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol: Option<NodeProtocol>,
}

/// What the node and the coordinators of the fleet speak, as `nodes` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum NodeProtocol {
    /// Its newest session speaks this version.
    Speaks { version: ProtocolVersion },
    /// Its last hello was refused: the agent and the coordinator share no version.
    Refused(Incompatible),
}

impl std::fmt::Display for NodeProtocol {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NodeProtocol::Speaks { version } => write!(f, "{version}"),
            NodeProtocol::Refused(versions) => write!(f, "refused: {versions}"),
        }
    }
}

/// When and how the operator ended a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ending {
    pub end: NodeEnd,
    pub at_ms: u64,
}

impl NodeRecord {
    /// Whether placement may give it a new run: not drained, retired or revoked.
    pub fn takes_runs(&self) -> bool {
        self.drained_since_ms.is_none() && self.ended.is_none()
    }

    /// How many runs it takes at once: the lower of what its agent declares and what the
    /// operator set; None when neither limits it (an agent from before capacities).
    pub fn capacity(&self) -> Option<u32> {
        capacity_of(self.facts.as_ref().and_then(|f| f.max_runs), self.capacity)
    }
}

/// A node's capacity from what its agent declares and what the operator set (see
/// [`NodeRecord::capacity`]).
pub(crate) fn capacity_of(declared: Option<u32>, set: Option<u32>) -> Option<u32> {
    match (declared, set) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// What saying why a node keeps runs waiting needs of it, without its facts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeBrief {
    pub id: NodeId,
    pub lease_until_ms: u64,
    pub capacity: Option<u32>,
}

/// One run on one node, as the coordinator records it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunRow {
    pub id: RunId,
    pub set_id: SetId,
    /// Its place among its set's runs, so runs created together go out in that order.
    #[serde(default)]
    pub position: u32,
    pub node_id: NodeId,
    pub state: RunState,
    pub workload: Workload,
    /// The image's pull needs the registry credential the serving coordinator holds in memory.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub needs_registry_auth: bool,
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
    /// The key (`sha256:` of its DER) whose signature the signing policy found on the image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signed_by: Option<String>,
    /// `run --retry-lost N`: how often, and where, the run is placed again when its machine
    /// goes away.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry: Option<Retry>,
    /// Which attempt of the run this row is: 1 for the first.
    #[serde(default = "first_attempt")]
    pub attempt: u32,
    /// The attempt this one replaces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous: Option<RunId>,
    /// Set once it was lost and placed again: the attempt that replaces it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retried_as: Option<RunId>,
    /// Queued for a match: no node matched when it was asked for, so it waits under
    /// [`unplaced`] until a node this expression matches joins (one not holding a row of its set).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queued_for: Option<crate::placement::Selector>,
}

/// A run not final, in brief: what the sweep, the census and the nodes page read of every such
/// run, without its workload, options, report and events (100 000 queued runs read whole each
/// heartbeat held several hundred MiB at once).
#[derive(Debug, Clone, Deserialize)]
pub struct ActiveRun {
    pub id: RunId,
    pub node_id: NodeId,
    pub state: RunState,
    pub created_ms: u64,
    /// Why it was refused or still waits, as in [`RunRow::error`].
    #[serde(default)]
    pub error: Option<String>,
    #[serde(default)]
    pub queued_for: Option<crate::placement::Selector>,
}

/// The node a run queued for a match waits under until one matches; never a node's id (those
/// are `n-` and hex).
pub fn unplaced() -> NodeId {
    NodeId::new("unplaced")
}

fn first_attempt() -> u32 {
    1
}

/// A run's retries left, and the expression its attempts are placed by.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Retry {
    pub left: u32,
    #[serde(rename = "where")]
    pub place: crate::placement::Selector,
}

impl RunRow {
    /// The content the run refers to by digest: its program, if it executes one, and its
    /// inputs; each holds a reference on its blob while the run is stored.
    pub fn content(&self) -> Vec<fleet_proto::Digest> {
        let program = match &self.workload {
            Workload::Program(digest) => Some(*digest),
            Workload::Image(_) => None,
        };
        (program.into_iter())
            .chain(self.options.inputs.iter().map(|(_, d)| *d))
            .collect()
    }
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
// Nearly every event is `Known`: boxing it would cost an allocation per event to shrink the rare
// variant.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum NodeEvent {
    Known(Event),
    Unreadable {
        id: u64,
        run_id: RunId,
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

    pub fn run_id(&self) -> &RunId {
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
    /// The database could not be reached or refused the connection; `url` has no password.
    #[error("cannot connect to the coordinator store {url}: {reason}: {hint}")]
    Unreachable {
        url: String,
        reason: String,
        /// What to do about it.
        hint: &'static str,
    },
    /// `url` (with no password) cannot be used: the driver cannot read it, or a file it names
    /// cannot be; `reason` says what to do.
    #[error("the coordinator store URL {url} cannot be used: {reason}")]
    Url { url: String, reason: String },
    /// The store was written with another schema version, or holds no version at all (it is not
    /// a coordinator store); it is left as it is.
    #[error("{}", schema_message(store, *found, *expected))]
    Schema {
        /// The store's file or database, as its backend names it.
        store: String,
        /// The version recorded in the store; None when it records none.
        found: Option<u64>,
        /// The version this coordinator reads and writes.
        expected: u64,
    },
    /// A change the rules do not allow (a caller's mistake, not the store's).
    #[error("the coordinator store refused a change: {0}")]
    Refused(String),
    #[error("the coordinator store failed: {0}")]
    Db(String),
    /// The database cut the connection (it shuts down or restarted): the same change may succeed
    /// once it is back.
    #[error("the coordinator store's connection was cut: {0}; it is tried again")]
    Cut(String),
    #[error("the coordinator store holds a corrupt record under {0}")]
    Corrupt(String),
}

/// A digest as a backend stored it: one that does not read back is a corrupt record.
fn stored_digest(text: &str) -> StoreResult<Digest> {
    Digest::parse(text).map_err(|_| StoreError::Corrupt(format!("a content reference {text}")))
}

impl From<fleet_cli::blocking::Unfinished> for StoreError {
    fn from(e: fleet_cli::blocking::Unfinished) -> StoreError {
        StoreError::Db(e.to_string())
    }
}

fn schema_message(store: &str, found: Option<u64>, expected: u64) -> String {
    match found {
        Some(found) => format!(
            "the coordinator store {store} has schema version {found}, but this coordinator reads version {expected}: run the coordinator that wrote it, or move the store aside"
        ),
        None => format!(
            "{store} records no schema version: it is not a coordinator store, or one written before stores recorded their version (this coordinator writes version {expected}); it is left untouched: move it aside or choose another data directory"
        ),
    }
}

impl StoreError {
    /// The database could not be reached: the same change may succeed once it is back.
    pub fn is_outage(&self) -> bool {
        matches!(self, StoreError::Unreachable { .. } | StoreError::Cut(_))
    }
}

pub type StoreResult<T> = Result<T, StoreError>;

/// A run id as a backend read it back from an index: written valid, so one that is not is a
/// corrupt record.
pub(crate) fn stored_run_id(text: &str) -> StoreResult<RunId> {
    RunId::parse(text).map_err(|_| StoreError::Corrupt(format!("the run id {text:?}")))
}

/// What a backend finds where its store should be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Nothing at all yet: the store is created there.
    Blank,
    /// A coordinator store of this schema version.
    Version(u64),
    /// Something else (records without a schema version): refused, never overwritten.
    Unversioned,
}

/// What a database provides to [`Store`]: typed records inside transactions. It holds no rules;
/// every method does exactly what it says to the records named.
pub trait Backend: Send + Sync {
    /// Which database this is (`redb`, `postgres`), for metrics.
    fn kind(&self) -> &'static str;
    /// How many calls at once are worth running: more only queue on the database's locks or
    /// connections, each holding a thread of tokio's blocking pool meanwhile.
    fn parallel_calls(&self) -> usize;
    /// Measures again the tables that grew past what the planner last measured (PostgreSQL:
    /// ANALYZE, which autovacuum does only a minute or more later); returns their names.
    fn refresh_statistics(&self) -> StoreResult<Vec<String>> {
        Ok(Vec::new())
    }
    /// The store's file or database, for messages.
    fn location(&self) -> String;
    /// A setting of the database that will slow a large fleet, as one line for the log of
    /// `serve`: what it is and what to set instead.
    fn tuning_advice(&self) -> StoreResult<Option<String>> {
        Ok(None)
    }
    /// What is there: nothing, a coordinator store of some version, or something else.
    fn layout(&self) -> StoreResult<Layout>;
    /// Lays out a blank store and records `version` as its schema version.
    fn create(&self, version: u64) -> StoreResult<()>;
    /// Moves a store of schema version `from` to `to` (both known to this backend, `from` lower)
    /// in one transaction, keeping every record.
    fn upgrade(&self, from: u64, to: u64) -> StoreResult<()>;
    /// Runs `f` on a consistent snapshot.
    fn read(&self, f: &mut dyn FnMut(&dyn ReadTx) -> StoreResult<()>) -> StoreResult<()>;
    /// What a session reads to dispatch, on one snapshot: the rows in the node's waiting index,
    /// how many runs the node holds not final, and its record. Read by every session each time
    /// a run of its node ends, so a backend may answer it in one round trip.
    fn dispatch_view(&self, node_id: &NodeId) -> StoreResult<DispatchView> {
        let mut view = None;
        self.read(&mut |tx| {
            let ids = tx.waiting(node_id)?;
            view = Some(DispatchView {
                waiting: tx.runs(&ids)?,
                out: tx.active(Some(node_id))?.len() as u64,
                node: tx.node(node_id)?,
            });
            Ok(())
        })?;
        view.ok_or_else(|| StoreError::Db("the backend skipped a read".into()))
    }
    /// Runs `f` in one transaction: committed when `f` returns Ok, rolled back when it fails. A
    /// backend may run `f` again after a conflict (a serialization failure in PostgreSQL); only
    /// the committed run's writes count.
    fn write(&self, f: &mut dyn FnMut(&mut dyn WriteTx) -> StoreResult<()>) -> StoreResult<()>;
    /// Runs `f`, which places new runs, in one transaction that a backend may run without a
    /// serializable snapshot: `f` holds the node-change count ([`WriteTx::hold_node_changes`])
    /// before it reads the nodes, and otherwise only inserts rows and adds to counts. A set of
    /// 30 000 runs read beside a busy fleet's commits would otherwise never commit in
    /// PostgreSQL: every session's write would be a conflict for it.
    fn write_placing(
        &self,
        f: &mut dyn FnMut(&mut dyn WriteTx) -> StoreResult<()>,
    ) -> StoreResult<()> {
        self.write(f)
    }
    /// [`Backend::write`] for a group commit's batch, which its caller can split: a backend
    /// whose transactions conflict may give up sooner, so the batch is applied in halves instead
    /// of redone whole while other coordinators' writes keep failing it.
    fn write_batch(
        &self,
        f: &mut dyn FnMut(&mut dyn WriteTx) -> StoreResult<()>,
    ) -> StoreResult<()> {
        self.write(f)
    }
    /// Writes heartbeats: only the lease and the time heard of each known node, never earlier
    /// than what is there. Apart from the rules' transactions, so a backend may use a cheaper
    /// isolation for these blind, monotonic writes. Answers the beats left for the next write
    /// (see [`WriteTx::touch_nodes`]).
    fn write_leases(&self, beats: &[Beat]) -> StoreResult<Vec<Beat>> {
        let mut left = Vec::new();
        self.write(&mut |tx| {
            left = tx.touch_nodes(beats)?;
            Ok(())
        })?;
        Ok(left)
    }
    /// Waits up to `timeout` for another coordinator of the same store to say that runs were
    /// put in the waiting index (a committed [`WriteTx::put_waiting`] says so): Ok(true) when one
    /// did. None from a store that only one coordinator opens, which has nobody to hear from.
    fn wait_for_waiting(&self, timeout: std::time::Duration) -> Option<StoreResult<bool>> {
        let _ = timeout;
        None
    }
}

/// Reads inside a transaction.
pub trait ReadTx {
    /// Token hash -> token.
    fn token(&self, hash: &str) -> StoreResult<Option<TokenRecord>>;
    /// Every token with its hash, in any order.
    fn tokens(&self) -> StoreResult<Vec<(String, TokenRecord)>>;
    fn node(&self, id: &NodeId) -> StoreResult<Option<NodeRecord>>;
    /// Every node, in any order.
    fn nodes(&self) -> StoreResult<Vec<NodeRecord>>;
    /// The nodes that take no new run (drained, retired or revoked), in any order: what placing
    /// a set checks, without every node's record and facts (30 000 of them for a `run --all`).
    fn closed_nodes(&self) -> StoreResult<Vec<NodeRecord>> {
        Ok((self.nodes()?.into_iter())
            .filter(|n| !n.takes_runs())
            .collect())
    }
    /// Every node's lease end, in any order: what the run sweep judges by, without the records.
    fn lease_ends(&self) -> StoreResult<Vec<(NodeId, u64)>> {
        Ok((self.nodes()?.into_iter())
            .map(|n| (n.id, n.lease_until_ms))
            .collect())
    }
    /// Every node's lease end and capacity, in any order: what `status` says a waiting run waits
    /// for, without the records (30 000 nodes' facts were read for each `status --set`).
    fn node_briefs(&self) -> StoreResult<Vec<NodeBrief>> {
        Ok((self.nodes()?.into_iter())
            .map(|n| NodeBrief {
                capacity: n.capacity(),
                id: n.id,
                lease_until_ms: n.lease_until_ms,
            })
            .collect())
    }
    /// Program digest -> its bytes.
    /// How many references stored runs hold on the content (0 when unknown).
    fn program_refs(&self, digest: &Digest) -> StoreResult<u64>;
    /// Every digest a stored run refers to (a reference count above zero), in any order.
    fn referenced_content(&self) -> StoreResult<Vec<Digest>>;
    fn run(&self, id: &RunId) -> StoreResult<Option<RunRow>>;
    /// The runs stored under `ids` (those that are), in any order: one read where the database
    /// can, one per run where that costs nothing more (an embedded store).
    fn runs(&self, ids: &[RunId]) -> StoreResult<Vec<RunRow>> {
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            out.extend(self.run(id)?);
        }
        Ok(out)
    }
    /// Set id -> the ids of its runs, in the order they were created.
    fn set(&self, id: &SetId) -> StoreResult<Option<Vec<RunId>>>;
    /// The ids of the runs in the active index, for one node or for all, in any order.
    fn active(&self, node_id: Option<&NodeId>) -> StoreResult<Vec<RunId>>;
    /// Every run in the active index, in brief, in any order.
    fn active_brief(&self) -> StoreResult<Vec<ActiveRun>>;
    /// Whether the node holds any run in the active index (one entry read, however many).
    fn holds_active(&self, node_id: &NodeId) -> StoreResult<bool>;
    /// The ids of the runs in the waiting index of one node (read by that index), in any order.
    fn waiting(&self, node_id: &NodeId) -> StoreResult<Vec<RunId>>;
    /// The nodes with at least one run in the waiting index, each once.
    fn waiting_nodes(&self) -> StoreResult<Vec<NodeId>>;
    /// How many runs each node holds in the active index (nodes with none are absent).
    fn active_counts(&self) -> StoreResult<BTreeMap<NodeId, u64>>;
    /// How many runs the node's retention order holds.
    fn final_count(&self, node_id: &NodeId) -> StoreResult<u64>;
    /// Every coordinator that serves this store, by advertised address, with when it last said so.
    fn coordinators(&self) -> StoreResult<Vec<(String, u64)>>;
    /// How many times the operator ended a node (retired or revoked) or set its capacity: a
    /// coordinator that sees it change reads the nodes, cuts the sessions of the ended ones and
    /// has those whose capacity changed look at their runs again. Kept
    /// under the key `node_ends`, its name before it counted changes too.
    fn node_changes(&self) -> StoreResult<u64>;
    /// One entry of the fleet's own table, as its text.
    fn fleet_entry(&self, entry: FleetEntry) -> StoreResult<Option<String>>;
}

/// What the fleet's own table holds, one text each, which every coordinator of the fleet reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FleetEntry {
    /// The public key of the fleet's coordinators (`ed25519:...`), recorded by the first one
    /// that opened the store.
    PublicKey,
    /// The root keys a release must be certified by (a JSON list of `ed25519:...`).
    ReleaseRoots,
    /// The releases taken in (a JSON list of [`ReleaseRecord`]).
    Releases,
    /// Release keys revoked (a JSON list of `ed25519:...`): a release they signed is neither
    /// taken in nor sent.
    RevokedReleaseKeys,
    /// The fleet's rollout, the one being driven or the last one (`crate::rollout::Rollout`).
    Rollout,
}

impl FleetEntry {
    pub fn key(self) -> &'static str {
        match self {
            FleetEntry::PublicKey => "public_key",
            FleetEntry::ReleaseRoots => "release_roots",
            FleetEntry::Releases => "releases",
            FleetEntry::RevokedReleaseKeys => "revoked_release_keys",
            FleetEntry::Rollout => "rollout",
        }
    }
}

/// A release the fleet took in (`release add`): its manifest and signature as they were signed,
/// so a coordinator hands each agent what the agent checks itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReleaseRecord {
    /// The manifest's exact bytes, in base64.
    pub manifest: String,
    pub signature: fleet_proto::release::ReleaseSignature,
    pub manifest_read: fleet_proto::release::ReleaseManifest,
    pub added_at_ms: u64,
}

impl ReleaseRecord {
    /// What a node is sent: the manifest as signed and its signature.
    pub fn offer(&self) -> fleet_proto::release::ReleaseOffer {
        fleet_proto::release::ReleaseOffer {
            manifest: self.manifest.clone(),
            signature: self.signature.clone(),
        }
    }
}

/// Writes inside a transaction (on top of its reads, which see them).
pub trait WriteTx: ReadTx {
    fn put_token(&mut self, hash: &str, token: &TokenRecord) -> StoreResult<()>;
    fn remove_token(&mut self, hash: &str) -> StoreResult<()>;
    /// Writes the record the operator and the rules change. Neither its lease (see
    /// [`WriteTx::put_lease`]) nor its `last_event_id` ([`WriteTx::set_last_event_id`]) is
    /// written: heartbeats write those apart, so they never meet a transaction on the record.
    fn put_node(&mut self, node: &NodeRecord) -> StoreResult<()>;
    /// Writes the node's lease and time heard, never earlier than what is there (a new node's
    /// lease is made here).
    fn put_lease(
        &mut self,
        node_id: &NodeId,
        heard_ms: Option<u64>,
        lease_until_ms: u64,
    ) -> StoreResult<()>;
    /// Writes only the heartbeat and lease of each known node (an unknown one is skipped);
    /// answers the beats of nodes whose record another transaction holds now, not written.
    fn touch_nodes(&mut self, beats: &[Beat]) -> StoreResult<Vec<Beat>>;
    /// Records the highest event id stored from the node (read back in its record).
    fn set_last_event_id(&mut self, node_id: &NodeId, id: u64) -> StoreResult<()>;
    fn set_program_refs(&mut self, digest: &Digest, refs: u64) -> StoreResult<()>;
    /// Adds `count` references to the content: in one step where a backend can (a transaction
    /// without a serializable snapshot then loses no other's change to it).
    fn add_program_refs(&mut self, digest: &Digest, count: u64) -> StoreResult<()> {
        let refs = self.program_refs(digest)?;
        self.set_program_refs(digest, refs + count)
    }
    /// Removes the content's reference count.
    fn remove_program(&mut self, digest: &Digest) -> StoreResult<()>;
    /// Writes the run; a backend may hold the write until commit (its reads see it at once).
    fn put_run(&mut self, run: &RunRow) -> StoreResult<()>;
    /// Tells the transaction which runs it is about to read, so a backend may read them in one
    /// round trip instead of one each.
    fn read_runs_ahead(&mut self, ids: &[RunId]) -> StoreResult<()> {
        let _ = ids;
        Ok(())
    }
    /// The same for the nodes the transaction is about to read.
    fn read_nodes_ahead(&mut self, ids: &[NodeId]) -> StoreResult<()> {
        let _ = ids;
        Ok(())
    }
    /// Records new runs, each in its node's active and waiting indexes; refused, naming it, when
    /// a run exists already. A backend may write them all in a few statements: a set of 10 000
    /// runs must not hold a transaction open while busy sessions commit.
    fn put_new_runs(&mut self, runs: &[RunRow]) -> StoreResult<()> {
        for run in runs {
            if self.run(&run.id)?.is_some() {
                return Err(run_exists(&run.id));
            }
            self.put_run(run)?;
            self.put_active(&run.id, &run.node_id)?;
            self.put_waiting(&run.id, &run.node_id)?;
        }
        Ok(())
    }
    fn remove_run(&mut self, id: &RunId) -> StoreResult<()>;
    fn put_set(&mut self, id: &SetId, run_ids: &[RunId]) -> StoreResult<()>;
    fn remove_set(&mut self, id: &SetId) -> StoreResult<()>;
    /// Adds a run to the active index under its node.
    fn put_active(&mut self, run_id: &RunId, node_id: &NodeId) -> StoreResult<()>;
    fn remove_active(&mut self, run_id: &RunId, node_id: &NodeId) -> StoreResult<()>;
    /// Adds a run to its node's waiting index.
    fn put_waiting(&mut self, run_id: &RunId, node_id: &NodeId) -> StoreResult<()>;
    fn remove_waiting(&mut self, run_id: &RunId, node_id: &NodeId) -> StoreResult<()>;
    /// Appends a run to its node's retention order (after every run appended before).
    fn push_final(&mut self, run_id: &RunId, node_id: &NodeId) -> StoreResult<()>;
    /// Takes the node's oldest run out of its retention order.
    fn pop_final(&mut self, node_id: &NodeId) -> StoreResult<Option<RunId>>;
    /// Records that the coordinator at `address` serves this store, at `seen_ms`.
    fn put_coordinator(&mut self, address: &str, seen_ms: u64) -> StoreResult<()>;
    /// Counts one more node closed to new runs (drained, ended, forgotten) or capacity set (see
    /// [`ReadTx::node_changes`]).
    fn count_node_change(&mut self) -> StoreResult<()>;
    /// Holds the node-change count until commit, without changing it. A transaction that places
    /// runs without a serializable snapshot ([`Backend::write_placing`]) holds it before it reads
    /// the nodes: a closing transaction (each counts a change) that committed first is seen, and
    /// one that began before and commits after is made to start again, and sees the runs.
    fn hold_node_changes(&mut self) -> StoreResult<()> {
        Ok(())
    }
    /// Writes one entry of the fleet's own table (see [`ReadTx::fleet_entry`]).
    fn set_fleet_entry(&mut self, entry: FleetEntry, value: &str) -> StoreResult<()>;
    /// Removes the node's record, lease and event mark; its runs stay as history.
    fn remove_node(&mut self, id: &NodeId) -> StoreResult<()>;
}

/// Why a new run cannot be recorded.
pub(crate) fn run_exists(id: &RunId) -> StoreError {
    StoreError::Refused(format!("the run {id} exists already"))
}

/// See [`Backend::dispatch_view`]; the waiting rows come in no particular order.
pub struct DispatchView {
    pub waiting: Vec<RunRow>,
    pub out: u64,
    pub node: Option<NodeRecord>,
}

/// Everything the coordinator remembers, over one backend; each method is one transaction. The
/// methods are in `rules.rs`.
pub struct Store {
    backend: Box<dyn Backend>,
    keep_final_runs: u64,
}

crate::placement::described_by_fields!(NodeRecord);

impl crate::placement::Candidate for NodeRecord {
    fn id(&self) -> &NodeId {
        &self.id
    }

    fn available(&self, now: u64) -> bool {
        self.takes_runs() && now < self.lease_until_ms
    }
}
