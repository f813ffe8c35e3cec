//! [`DockerRuntime`]: images run as containers through the Docker Engine API (bollard), never
//! through the `docker` CLI.
//!
//! Each run is one container named `octomy-run-<run>` and labelled with its run id, so the
//! engine itself refuses a second container for a run and everything this runtime knows lives
//! in the engine: a restarted agent re-adopts its runs by label. An image is pulled by its exact
//! digest, once; the registry credential travels only in that one request's `X-Registry-Auth`
//! header. The engine's init is the container's first process, so an abort ends in 134 and a
//! kill in 137. A timeout is enforced by a timer set when the run starts (or is first observed
//! running, after an agent restart): at its deadline the engine stops the container with the
//! run's grace, then kills it. Why a run ended (its timeout, an operator's stop) is the one
//! thing the engine cannot hold; it is a marker file under this runtime's folder, written
//! before the stop is asked. The engine's event stream (this agent's containers dying) and the
//! timers note runs in [`Changes`], so the agent reports an end at once (a start is reported
//! from the start's own answer).
//!
//! The [`Runtime`] trait is blocking; this runtime owns a one-thread tokio runtime and blocks on
//! it, so it can be called from any thread (the agent calls it from `spawn_blocking`).
mod collect;
mod engine;
mod events;
mod launch;
mod marks;
mod observe;
mod pull;
mod tidy;
mod time;
mod timers;

pub use engine::{EngineAddress, TlsFiles};
pub use tidy::Tidy;

use super::{Changes, Collected, RunSpec, RunState, RunStatus, Runtime, RuntimeError, Started};
use bollard::Docker;
use bollard::errors::Error as ApiError;
use fleet_proto::RunId;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use timers::Timers;

/// The label holding a container's run id; every container of this project carries it.
pub const LABEL_RUN: &str = "io.octomy.run";
/// The label naming the agent (its namespace) that owns the container.
pub const LABEL_AGENT: &str = "io.octomy.agent";
const LABEL_TIMEOUT_MS: &str = "io.octomy.timeout-ms";
const LABEL_GRACE_MS: &str = "io.octomy.grace-ms";
const LABEL_OUTPUT_LIMIT: &str = "io.octomy.output-limit";
/// Where a run's input files are, and its working folder (what `collect` reads from).
pub const RUN_DIR: &str = "/run";
/// The grace between the polite stop and the kill when a run names none.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(10);
/// How long a pull may go without a progress message before it is abandoned.
pub const DEFAULT_PULL_STALL: Duration = Duration::from_secs(60);
const NAME: &str = "docker";

/// The run a container's labels name; a label that is no run id names no run of this agent.
pub(super) fn labelled_run(labels: Option<&HashMap<String, String>>) -> Option<RunId> {
    labels
        .and_then(|l| l.get(LABEL_RUN))
        .and_then(|l| RunId::parse(l).ok())
}

/// A run's container name: the engine refuses a second container of one name, which makes the
/// name the run's claim.
pub fn container_name(run_id: &RunId) -> String {
    format!("octomy-run-{run_id}")
}

/// Runs images as containers on one Docker engine.
pub struct DockerRuntime {
    docker: Docker,
    /// Taken on drop, which shuts it down without blocking (a drop may happen on async code).
    rt: Option<tokio::runtime::Runtime>,
    /// Where the stop and timeout markers live.
    marks: PathBuf,
    agent: String,
    pull_stall: Duration,
    tidy: Tidy,
    last_tidy: Mutex<Option<std::time::Instant>>,
    engine_version: engine::EngineVersion,
    /// Final runs never change again: their status is read once.
    finished: Mutex<HashMap<RunId, RunStatus>>,
    timers: Arc<Timers>,
}

impl std::fmt::Debug for DockerRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DockerRuntime")
            .field("engine", &self.engine_version)
            .field("agent", &self.agent)
            .finish()
    }
}

impl DockerRuntime {
    /// Connects to the engine at `address`, negotiating the API version. `marks` is this
    /// runtime's own folder; `agent` names the agent whose containers these are (a label), so
    /// agents sharing an engine never touch each other's runs; runs that end (as the engine
    /// reports them, or stopped by their timeout's timer) are noted in `changes`.
    pub fn connect(
        address: &EngineAddress,
        marks: impl Into<PathBuf>,
        agent: &str,
        changes: Changes,
    ) -> Result<DockerRuntime, RuntimeError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("docker-api")
            .enable_all()
            .build()
            .map_err(|e| RuntimeError::Failed {
                what: "starting the Docker client".into(),
                reason: e.to_string(),
            })?;
        let (docker, engine_version) = {
            let _entered = rt.enter();
            rt.block_on(engine::connect(address))?
        };
        rt.spawn(events::watch_events(
            docker.clone(),
            agent.to_string(),
            changes.clone(),
        ));
        let marks = marks.into();
        let timers = Arc::new(Timers::new(docker.clone(), marks.clone(), changes));
        Ok(DockerRuntime {
            docker,
            rt: Some(rt),
            marks,
            agent: agent.to_string(),
            pull_stall: DEFAULT_PULL_STALL,
            tidy: Tidy::default(),
            last_tidy: Mutex::new(None),
            engine_version,
            finished: Mutex::new(HashMap::new()),
            timers,
        })
    }

    fn rt(&self) -> &tokio::runtime::Runtime {
        self.rt
            .as_ref()
            // Cannot fail: the runtime is a field dropped only with the client.
            .expect("the client's runtime lives until drop")
    }

    /// A pull that goes this long without a progress message is abandoned.
    pub fn with_pull_stall(mut self, stall: Duration) -> DockerRuntime {
        self.pull_stall = stall;
        self
    }

    /// How strays and finished containers are cleaned up (see [`Tidy`]).
    pub fn with_tidy(mut self, tidy: Tidy) -> DockerRuntime {
        self.tidy = tidy;
        self
    }

    /// The engine's version and API version, shown as `20.10.24 (API 1.41)`.
    pub fn engine_version(&self) -> &engine::EngineVersion {
        &self.engine_version
    }

    /// Has the engine read `image`'s manifest from its registry (`GET /distribution/NAME/json`),
    /// as a pull would reach it; answers the manifest's digest.
    pub fn read_manifest(&self, image: &str) -> Result<fleet_proto::Digest, RuntimeError> {
        let failed = |reason: String| RuntimeError::Failed {
            what: format!("reading the manifest of {image} from its registry"),
            reason,
        };
        let inspected = self
            .rt()
            .block_on(self.docker.inspect_registry_image(image, None))
            .map_err(|e| failed(describe(&e)))?;
        let digest = inspected.descriptor.digest.unwrap_or_default();
        fleet_proto::Digest::parse(&digest)
            .map_err(|_| failed(format!("the registry answered the digest {digest:?}")))
    }

    /// The manifest digests of the engine's images (`RepoDigests`), each once.
    pub fn image_digests(&self) -> Result<Vec<fleet_proto::Digest>, RuntimeError> {
        let images = self
            .rt()
            .block_on(
                self.docker
                    .list_images(None::<bollard::query_parameters::ListImagesOptions>),
            )
            .map_err(|e| RuntimeError::Failed {
                what: "listing the engine's images".into(),
                reason: describe(&e),
            })?;
        let mut digests: Vec<fleet_proto::Digest> = (images.iter())
            .flat_map(|i| i.repo_digests.iter())
            .filter_map(|d| fleet_proto::Digest::parse(d.rsplit_once('@')?.1).ok())
            .collect();
        digests.sort();
        digests.dedup();
        Ok(digests)
    }

    /// The API version this client speaks with the engine: the engine's own when it is older
    /// than the client's newest (negotiated at connect).
    pub fn api_version(&self) -> String {
        self.docker.client_version().to_string()
    }

    fn engine_error(&self, run_id: &RunId, what: &str, e: ApiError) -> RuntimeError {
        RuntimeError::Refused {
            run_id: run_id.clone(),
            reason: format!("the Docker engine could not {what}: {}", describe(&e)),
        }
    }
}

impl Drop for DockerRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

impl Runtime for DockerRuntime {
    fn stage(&self, file: &Path) -> Result<fleet_proto::Digest, RuntimeError> {
        Err(RuntimeError::Failed {
            what: format!("staging {}", file.display()),
            reason: "the docker runtime runs images, not staged programs; stage it on the process runtime".into(),
        })
    }

    fn start(&self, spec: &RunSpec) -> Result<Started, RuntimeError> {
        let (image, argv) = launch::image_and_argv(spec)?;
        self.rt().block_on(self.start_async(spec, &image, argv))
    }

    fn stop(&self, run_id: &RunId) -> Result<(), RuntimeError> {
        self.rt().block_on(self.stop_async(run_id))
    }

    fn status(&self, run_id: &RunId) -> Result<RunStatus, RuntimeError> {
        self.rt().block_on(self.observe(run_id))
    }

    fn collect(
        &self,
        run_id: &RunId,
        path: &str,
        max_bytes: u64,
        sink: &mut dyn std::io::Write,
    ) -> Result<Collected, RuntimeError> {
        collect::collect(self, run_id, path, max_bytes, sink)
    }

    fn list(&self) -> Result<Vec<RunStatus>, RuntimeError> {
        self.rt().block_on(self.list_async())
    }

    fn tidy(
        &self,
        record: &dyn Fn(&RunId) -> Option<RunState>,
    ) -> Result<Vec<RunId>, RuntimeError> {
        {
            let mut last = self
                .last_tidy
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if last.is_some_and(|at| at.elapsed() < self.tidy.every) {
                return Ok(Vec::new());
            }
            *last = Some(std::time::Instant::now());
        }
        self.rt().block_on(self.tidy_async(record))
    }
}

/// The engine's HTTP status for a refused request.
fn status_of(e: &ApiError) -> Option<u16> {
    match e {
        ApiError::DockerResponseServerError { status_code, .. } => Some(*status_code),
        _ => None,
    }
}

/// One line for an API error: the engine's own message when it sent one.
fn describe(e: &ApiError) -> String {
    match e {
        ApiError::DockerResponseServerError { message, .. } => message.trim().to_string(),
        ApiError::DockerStreamError { error } => error.trim().to_string(),
        ApiError::SocketNotFoundError(path) => format!("the socket {path} does not exist"),
        other => other.to_string(),
    }
}
