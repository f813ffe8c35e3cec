//! The coordinator: the hub's endpoint for the node protocol. A hub embeds [`Coordinator`] and
//! [`serve::serve`]; the `fleet-coordinator` binary drives the same code.
//!
//! API: `Coordinator` (open, tokens, nodes, and the run API in `runs`), `serve` (the port),
//! `operator` (requests a CLI or hub sends to a serving coordinator), `store` (the store
//! and its rules, over a backend: the embedded redb one or PostgreSQL, by [`StoreLocation`]),
//! `userdata` (the `#cloud-config`).
pub mod commit;
pub mod content;
pub mod http;
pub mod operator;
pub mod peer;
pub mod runs;
pub mod serve;
pub mod store;
pub mod userdata;

use base64::Engine;
use fleet_proto::facts::Facts;
use fleet_proto::fsutil::{self, now_ms};
use fleet_proto::joinfile::{JoinFile, Secret, TOKEN_PREFIX};
use fleet_proto::pin;
use rand::RngCore;
use rcgen::KeyPair;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use store::{
    Backend, KEEP_FINAL_RUNS, NodeRecord, PostgresBackend, RedbBackend, Store, StoreError,
    StoreResult, TokenRecord,
};

pub const DEFAULT_DATA: &str = "/var/lib/octomy-coordinator";
pub const DEFAULT_PORT: u16 = 18426;
pub const KEY_FILE: &str = "coordinator.key";
pub const STORE_FILE: &str = "coordinator.redb";

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

/// Where the coordinator keeps its records. The key stays in the data directory either way.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum StoreLocation {
    /// The embedded redb file in the data directory ([`STORE_FILE`]).
    #[default]
    Embedded,
    /// A PostgreSQL database, by URL.
    Postgres(String),
}

impl StoreLocation {
    /// `--store`: a `postgres://` or `postgresql://` URL (an error never shows its password).
    pub fn parse(text: &str) -> Result<StoreLocation, CoordinatorError> {
        if text.starts_with("postgres://") || text.starts_with("postgresql://") {
            Ok(StoreLocation::Postgres(text.to_string()))
        } else {
            Err(CoordinatorError::StoreChoice(store::postgres::redact(text)))
        }
    }

    fn backend(&self, data: &Path) -> StoreResult<Box<dyn Backend>> {
        Ok(match self {
            StoreLocation::Embedded => Box::new(RedbBackend::open(&data.join(STORE_FILE))?),
            StoreLocation::Postgres(url) => Box::new(PostgresBackend::open(url)?),
        })
    }
}

/// The coordinator's identity and store.
pub struct Coordinator {
    pub data: PathBuf,
    pub store: Arc<Store>,
    /// Sessions' store changes, applied in batches (group commit).
    pub commits: commit::Committer,
    pub key: KeyPair,
    /// Sessions and wake-ups while serving.
    pub live: runs::Live,
    /// Programs, inputs and collected files, by digest, under the data folder.
    pub blobs: fleet_proto::content::Blobs,
    /// Content bytes moved on the content path.
    pub content: content::Counters,
}

/// A join file to mint.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct TokenRequest {
    pub ttl_ms: u64,
    pub name: Option<String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// The advertised `host:port`; the serving coordinator fills in its own when absent.
    pub address: Option<String>,
    pub bundle_sha256: Option<String>,
}

/// Whether a node holds its lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum NodeState {
    Joined,
    #[serde(rename = "lost")]
    Lost,
    /// A machine handed a token reported that its bootstrap failed; it never joined.
    #[serde(rename = "failed")]
    Failed,
}

impl NodeState {
    pub fn as_str(self) -> &'static str {
        match self {
            NodeState::Joined => "Joined",
            NodeState::Lost => "lost",
            NodeState::Failed => "failed",
        }
    }
}

/// One row of `fleet-coordinator nodes`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeView {
    pub id: String,
    pub state: NodeState,
    pub name: Option<String>,
    pub public_key: String,
    pub labels: BTreeMap<String, String>,
    pub joined_at_ms: u64,
    pub last_heartbeat_ms: Option<u64>,
    /// How many sessions the node has opened; each new one fences the one before.
    #[serde(default)]
    pub sessions: u64,
    pub facts: Option<Facts>,
    /// Why a `failed` machine did not join, as it reported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// A node's id follows from its key, so the same key always gets the same id.
/// The blob store under a data folder: `DATA/blobs/sha256/HEX`.
pub fn blobs(data: &Path) -> fleet_proto::content::Blobs {
    fleet_proto::content::Blobs::new(data.join("blobs"))
}

pub fn node_id(public_key: &[u8]) -> String {
    format!("n-{}", &hex::encode(Sha256::digest(public_key))[..16])
}

/// A fresh one-time token: the prefix and 32 random bytes.
fn new_token() -> String {
    let mut raw = [0u8; 32];
    rand::thread_rng().fill_bytes(&mut raw);
    format!(
        "{TOKEN_PREFIX}{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(raw)
    )
}

pub fn token_hash(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

impl Coordinator {
    /// Runs a store call on tokio's blocking pool: redb waits for its disk sync, and the serving
    /// coordinator's one async thread must go on reading every other session meanwhile.
    pub async fn with_store<T: Send + 'static>(
        &self,
        call: impl FnOnce(&Store) -> StoreResult<T> + Send + 'static,
    ) -> StoreResult<T> {
        let store = self.store.clone();
        tokio::task::spawn_blocking(move || call(store.as_ref()))
            .await
            .map_err(|e| StoreError::Db(format!("a store call did not complete: {e}")))?
    }

    /// Like [`open`](Self::open), but while another process holds the store (an operator command
    /// reading it for a moment) it tries again for up to `patience`.
    pub fn open_patiently(
        data: &Path,
        store: &StoreLocation,
        patience: std::time::Duration,
    ) -> Result<Coordinator, CoordinatorError> {
        let deadline = std::time::Instant::now() + patience;
        loop {
            match Coordinator::open(data, store) {
                Err(CoordinatorError::Store(StoreError::Locked(_)))
                    if std::time::Instant::now() < deadline =>
                {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                opened => return opened,
            }
        }
    }

    /// Opens (or creates) the data directory with its key (0600), and the store (in the data
    /// directory, or the database named).
    pub fn open(data: &Path, store: &StoreLocation) -> Result<Coordinator, CoordinatorError> {
        let data_err = |cause| CoordinatorError::DataDir {
            path: data.to_path_buf(),
            cause,
        };
        fsutil::create_private_dir(data).map_err(data_err)?;
        let key = load_or_create_key(&data.join(KEY_FILE))?;
        let store = Arc::new(Store::open(store.backend(data)?, KEEP_FINAL_RUNS)?);
        Ok(Coordinator {
            data: data.to_path_buf(),
            commits: commit::Committer::start(store.clone()),
            store,
            key,
            live: runs::Live::default(),
            blobs: blobs(data),
            content: Default::default(),
        })
    }

    pub fn public_key_text(&self) -> String {
        pin::key_text(self.key.public_key_raw())
    }

    /// Mints a one-time token, stores only its hash, and returns the join file that carries it.
    pub fn mint_token(
        &self,
        request: &TokenRequest,
        default_address: Option<&str>,
    ) -> Result<JoinFile, CoordinatorError> {
        let mut joins = self.mint_tokens(request, 1, default_address)?;
        joins
            .pop()
            .ok_or_else(|| CoordinatorError::Request("no token was minted".into()))
    }

    /// Mints `count` tokens of the same request in one transaction; returns their join files.
    pub fn mint_tokens(
        &self,
        request: &TokenRequest,
        count: usize,
        default_address: Option<&str>,
    ) -> Result<Vec<JoinFile>, CoordinatorError> {
        let address = request
            .address
            .clone()
            .or_else(|| default_address.map(str::to_string))
            .ok_or(CoordinatorError::NoAddress)?;
        let now = now_ms();
        let expires_at_ms = now + request.ttl_ms;
        let record = TokenRecord {
            expires_at_ms,
            name: request.name.clone(),
            labels: request.labels.clone(),
            spent_by: None,
            bootstrap_failure: None,
        };
        // The fleet's other coordinators now (on a shared store), for the node to try in turn.
        let alternates: Vec<String> = (self.live.fleet.lock().expect("fleet").iter())
            .filter(|other| **other != address)
            .cloned()
            .collect();
        let tokens: Vec<String> = (0..count).map(|_| new_token()).collect();
        let hashed: Vec<(String, TokenRecord)> = (tokens.iter())
            .map(|token| (token_hash(token), record.clone()))
            .collect();
        self.store.add_tokens(&hashed, now)?;
        Ok(tokens
            .into_iter()
            .map(|token| JoinFile {
                alternates: alternates.clone(),
                address: address.clone(),
                coordinator_key: self.public_key_text(),
                token: Secret(token),
                expires_at_ms: Some(expires_at_ms),
                ttl_ms: Some(request.ttl_ms),
                bundle_sha256: request.bundle_sha256.clone(),
                name: request.name.clone(),
                labels: request.labels.clone(),
            })
            .collect())
    }

    pub fn nodes(&self) -> Result<Vec<NodeView>, CoordinatorError> {
        let now = now_ms();
        let mut nodes: Vec<NodeView> = self
            .store
            .nodes()?
            .into_iter()
            .map(|n| view(n, now))
            .collect();
        nodes.extend(
            self.store
                .failed_bootstraps()?
                .into_iter()
                .map(|(hash, token)| failed_view(&hash, token)),
        );
        nodes.sort_by(|a, b| a.joined_at_ms.cmp(&b.joined_at_ms).then(a.id.cmp(&b.id)));
        Ok(nodes)
    }
}

fn view(node: NodeRecord, now: u64) -> NodeView {
    let state = if now < node.lease_until_ms {
        NodeState::Joined
    } else {
        NodeState::Lost
    };
    NodeView {
        id: node.id,
        state,
        name: node.name,
        public_key: node.public_key,
        labels: node.labels,
        joined_at_ms: node.joined_at_ms,
        last_heartbeat_ms: node.last_heartbeat_ms,
        sessions: node.generation,
        facts: node.facts,
        error: None,
    }
}

/// A machine that never joined: named by its token's hash (never the token), with its reason.
fn failed_view(token_hash: &str, token: TokenRecord) -> NodeView {
    let failure = token.bootstrap_failure.unwrap_or(store::BootstrapFailure {
        at_ms: 0,
        reason: String::new(),
    });
    NodeView {
        id: format!("token-{}", &token_hash[..token_hash.len().min(12)]),
        state: NodeState::Failed,
        name: token.name,
        public_key: "-".into(),
        labels: token.labels,
        joined_at_ms: failure.at_ms,
        last_heartbeat_ms: None,
        sessions: 0,
        facts: None,
        error: Some(format!("bootstrap failed: {}", failure.reason)),
    }
}

fn load_or_create_key(path: &Path) -> Result<KeyPair, CoordinatorError> {
    let corrupt = |reason: String| CoordinatorError::CorruptKey {
        path: path.to_path_buf(),
        reason,
    };
    match std::fs::read_to_string(path) {
        Ok(pem) => KeyPair::from_pem(&pem).map_err(|e| corrupt(e.to_string())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let key =
                KeyPair::generate_for(&rcgen::PKCS_ED25519).map_err(|e| corrupt(e.to_string()))?;
            fsutil::write_atomic(path, key.serialize_pem().as_bytes(), 0o600).map_err(|cause| {
                CoordinatorError::DataDir {
                    path: path.to_path_buf(),
                    cause,
                }
            })?;
            Ok(key)
        }
        Err(e) => Err(corrupt(e.to_string())),
    }
}

/// The SHA-256 of a file, hex.
pub fn file_sha256(path: &Path) -> std::io::Result<String> {
    let mut file = std::fs::File::open(path)?;
    let mut hasher = Sha256::new();
    std::io::copy(&mut file, &mut hasher)?;
    Ok(hex::encode(hasher.finalize()))
}

/// The bundle file for one architecture.
pub fn bundle_path(bundles: &Path, arch: &str) -> PathBuf {
    bundles.join(format!("hub-linux-{arch}.tar.gz"))
}
