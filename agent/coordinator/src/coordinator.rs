//! [`Coordinator`]: the fleet's key, its store and blob store, and the owners of what a serving
//! coordinator holds in memory (see `live`). Its fields are its own; the rest of the crate asks
//! for each part, and each part alone changes its state.
use crate::commit::Committer;
use crate::error::CoordinatorError;
use crate::folder::{KEY_FILE, POSTGRES_MARK, STORE_FILE};
use crate::live::{
    Beats, Credentials, FetchWindow, FleetView, JoinLimits, Pulls, Sessions, Tickets, Traffic,
    Uploads,
};
use crate::recorder::Recorder;
use crate::store::{
    self, Backend, KEEP_FINAL_RUNS, PostgresBackend, RedbBackend, Store, StoreError, StoreResult,
};
use fleet_content::Blobs;
use fleet_content::files;
use fleet_proto::pin;
use rcgen::KeyPair;
use std::path::{Path, PathBuf};
use std::sync::Arc;

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

    /// Records in `data` which kind of store its coordinator serves: an operator command that
    /// finds no coordinator on the folder's socket must not fall back to an empty embedded store
    /// in a folder whose fleet lives in PostgreSQL.
    pub fn mark(&self, data: &Path) -> std::io::Result<()> {
        let mark = data.join(POSTGRES_MARK);
        match self {
            StoreLocation::Postgres(_) => std::fs::write(mark, "postgres\n"),
            StoreLocation::Embedded => match std::fs::remove_file(mark) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
                _ => Ok(()),
            },
        }
    }

    fn backend(&self, data: &Path) -> StoreResult<Box<dyn Backend>> {
        Ok(match self {
            StoreLocation::Embedded => Box::new(RedbBackend::open(&data.join(STORE_FILE))?),
            StoreLocation::Postgres(url) => Box::new(PostgresBackend::open(url)?),
        })
    }
}

/// The blob store under a data folder: `DATA/blobs/sha256/HEX`.
pub fn blobs(data: &Path) -> Blobs {
    Blobs::new(data.join("blobs"))
}

/// The coordinator's identity, store and live state.
pub struct Coordinator {
    data: PathBuf,
    store: Arc<Store>,
    /// Sessions' store changes, applied in batches (group commit).
    commits: Committer,
    key: KeyPair,
    /// Programs, inputs and collected files, by digest, under the data folder.
    blobs: Blobs,
    sessions: Sessions,
    beats: Beats,
    credentials: Credentials,
    tickets: Tickets,
    uploads: Uploads,
    fleet: FleetView,
    traffic: Traffic,
    pulls: Pulls,
    fetch_window: FetchWindow,
    joins: JoinLimits,
    /// Store calls running at once on the blocking pool: when a submit wakes 10 000 sessions,
    /// the rest wait here as small futures, not as hundreds of threads contending for the store.
    store_calls: tokio::sync::Semaphore,
    /// TLS handshakes done at once: a crowd (every node of a coordinator that restarted) is
    /// served in turn, each within its timeout, not all at once and each past it (2 613 timed
    /// out so in a 30 000-node rolling restart, and their nodes moved on).
    handshakes: tokio::sync::Semaphore,
    /// The events the metrics count.
    recorder: Recorder,
}

/// Enough to keep the cores busy while some wait on slow clients (32 did not, at 30 000 nodes:
/// each turn was held for a busy load generator's answers), few enough to bound the crowd.
const HANDSHAKES_AT_ONCE: usize = 256;

impl Coordinator {
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
        files::create_private_dir(data).map_err(data_err)?;
        let key = load_or_create_key(&data.join(KEY_FILE))?;
        let store = Arc::new(Store::open(store.backend(data)?, KEEP_FINAL_RUNS)?);
        // Every coordinator of a fleet holds the same key: the nodes pin it.
        let ours = pin::key_text(key.public_key_raw());
        let fleet = store.claim_fleet_key(&ours)?;
        if fleet != ours {
            return Err(CoordinatorError::ForeignKey {
                data: data.to_path_buf(),
                ours,
                fleet,
                store: store.location(),
            });
        }
        let recorder = Recorder::default();
        let store_calls = tokio::sync::Semaphore::new(store.parallel_calls());
        Ok(Coordinator {
            data: data.to_path_buf(),
            commits: Committer::start(store.clone(), recorder.clone()),
            store,
            key,
            blobs: blobs(data),
            sessions: Sessions::default(),
            beats: Beats::default(),
            credentials: Credentials::default(),
            tickets: Tickets::default(),
            uploads: Uploads::default(),
            fleet: FleetView::default(),
            traffic: Traffic::default(),
            pulls: Pulls::default(),
            fetch_window: FetchWindow::default(),
            joins: JoinLimits::default(),
            store_calls,
            handshakes: tokio::sync::Semaphore::new(HANDSHAKES_AT_ONCE),
            recorder,
        })
    }

    /// Runs a store call on tokio's blocking pool: redb waits for its disk sync, and the serving
    /// coordinator's one async thread must go on reading every other session meanwhile.
    pub async fn with_store<T: Send + 'static>(
        &self,
        call: impl FnOnce(&Store) -> StoreResult<T> + Send + 'static,
    ) -> StoreResult<T> {
        // Cannot fail: the semaphore is never closed.
        let _turn = self.store_calls.acquire().await.expect("never closed");
        self.with_store_unqueued(call).await
    }

    /// [`Coordinator::with_store`] without waiting for a turn: for the lease writes alone, one
    /// call a second. Queued behind the sessions' calls, a lease write waits out their backlog,
    /// which while 10 000 sessions move in after a restart can pass a lease.
    pub async fn with_store_unqueued<T: Send + 'static>(
        &self,
        call: impl FnOnce(&Store) -> StoreResult<T> + Send + 'static,
    ) -> StoreResult<T> {
        let store = self.store.clone();
        fleet_cli::blocking::off_thread(move || call(store.as_ref())).await
    }

    pub fn public_key_text(&self) -> String {
        pin::key_text(self.key.public_key_raw())
    }

    /// The data folder: key, operator socket, blob store and the embedded store.
    pub fn data(&self) -> &Path {
        &self.data
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    pub fn blobs(&self) -> &Blobs {
        &self.blobs
    }

    pub(crate) fn key(&self) -> &KeyPair {
        &self.key
    }

    pub(crate) fn handshakes(&self) -> &tokio::sync::Semaphore {
        &self.handshakes
    }

    pub(crate) fn commits(&self) -> &Committer {
        &self.commits
    }

    pub(crate) fn sessions(&self) -> &Sessions {
        &self.sessions
    }

    pub(crate) fn beats(&self) -> &Beats {
        &self.beats
    }

    pub(crate) fn credentials(&self) -> &Credentials {
        &self.credentials
    }

    pub(crate) fn tickets(&self) -> &Tickets {
        &self.tickets
    }

    pub(crate) fn uploads(&self) -> &Uploads {
        &self.uploads
    }

    pub(crate) fn fleet(&self) -> &FleetView {
        &self.fleet
    }

    pub(crate) fn joins(&self) -> &JoinLimits {
        &self.joins
    }

    pub(crate) fn traffic(&self) -> &Traffic {
        &self.traffic
    }

    pub(crate) fn pulls(&self) -> &Pulls {
        &self.pulls
    }

    pub(crate) fn fetch_window(&self) -> &FetchWindow {
        &self.fetch_window
    }

    pub(crate) fn recorder(&self) -> &Recorder {
        &self.recorder
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
            files::write_private(path, key.serialize_pem().as_bytes()).map_err(|cause| {
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
