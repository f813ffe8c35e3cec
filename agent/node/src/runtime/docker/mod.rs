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
mod time;

pub use engine::{EngineAddress, TlsFiles};

use super::{
    Changes, Collected, Outcome, RunReport, RunSpec, RunState, RunStatus, Runtime, RuntimeError,
    Started, Workload,
};
use bollard::Docker;
use bollard::errors::Error as ApiError;
use bollard::models::{
    ContainerCreateBody, ContainerInspectResponse, ContainerStateStatusEnum, DeviceRequest,
    HostConfig,
};
use bollard::query_parameters::{
    CreateContainerOptions, CreateImageOptions, EventsOptions, ListContainersOptions, LogsOptions,
    RemoveContainerOptions, StopContainerOptions, UploadToContainerOptions,
};
use fleet_proto::run::{Gpus, ImageRef, OutputEnd, RegistryAuth};
use futures_util::StreamExt;
use sha2::Digest as _;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

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
/// The pause before the engine's event stream is opened again once it was cut.
const EVENTS_RETRY: Duration = Duration::from_secs(1);

/// A run's container name: the engine refuses a second container of one name, which makes the
/// name the run's claim.
pub fn container_name(run_id: &str) -> String {
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
    engine_version: String,
    /// Final runs never change again: their status is read once.
    finished: Mutex<HashMap<String, RunStatus>>,
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

/// Clean-up of this agent's containers, run from the agent's watch (at most every `every`): a
/// labelled container whose run no record on the node knows (a crash between the create and the
/// record) is removed once it is `stray_grace` old; beyond the newest `keep_finished` finished
/// runs, containers are removed (their records stay on the node and at the coordinator).
#[derive(Debug, Clone)]
pub struct Tidy {
    pub every: Duration,
    pub stray_grace: Duration,
    pub keep_finished: usize,
    /// An image this runtime pulled is removed once no container of this agent uses it and it
    /// was last started this long ago (an image it found present is never removed).
    pub image_delay: Duration,
}

impl Default for Tidy {
    fn default() -> Tidy {
        Tidy {
            every: Duration::from_secs(60),
            stray_grace: Duration::from_secs(10 * 60),
            keep_finished: 1000,
            image_delay: Duration::from_secs(60 * 60),
        }
    }
}

/// Why a run ended, when the engine cannot say: written before the stop is asked for.
#[derive(Clone, Copy)]
enum Mark {
    Stopped,
    TimedOut,
}

impl Mark {
    fn file(self) -> &'static str {
        match self {
            Mark::Stopped => "stopped",
            Mark::TimedOut => "timed-out",
        }
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
        rt.spawn(watch_events(
            docker.clone(),
            agent.to_string(),
            changes.clone(),
        ));
        let marks = marks.into();
        let timers = Arc::new(Timers {
            docker: docker.clone(),
            marks: marks.clone(),
            changes,
            armed: Mutex::new(HashSet::new()),
        });
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

    /// The engine's version and API version, as `20.10.24 (API 1.41)`.
    pub fn engine_version(&self) -> &str {
        &self.engine_version
    }

    /// The API version this client speaks with the engine: the engine's own when it is older
    /// than the client's newest (negotiated at connect).
    pub fn api_version(&self) -> String {
        self.docker.client_version().to_string()
    }

    fn mark_path(&self, run_id: &str, mark: Mark) -> PathBuf {
        mark_path(&self.marks, run_id, mark)
    }

    /// The file recording that this runtime pulled `image`; its time is the image's last start.
    fn image_mark(&self, image: &str) -> PathBuf {
        let name = hex::encode(sha2::Sha256::digest(image.as_bytes()));
        self.marks.join("images").join(name)
    }

    fn mark_image_used(&self, image: &str, pulled: bool) {
        let path = self.image_mark(image);
        if pulled || path.exists() {
            let written = std::fs::create_dir_all(path.parent().expect("under images/"))
                .and_then(|()| std::fs::write(&path, image));
            if let Err(e) = written {
                tracing::warn!(
                    "cannot record the use of {image} in {}: {e}",
                    path.display()
                );
            }
        }
    }

    fn marked(&self, run_id: &str, mark: Mark) -> bool {
        self.mark_path(run_id, mark).exists()
    }

    fn set_mark(&self, run_id: &str, mark: Mark) -> Result<(), RuntimeError> {
        set_mark(&self.marks, run_id, mark)
    }

    /// The run's container, if this agent has one by that name.
    async fn inspect(
        &self,
        run_id: &str,
    ) -> Result<Option<ContainerInspectResponse>, RuntimeError> {
        match self
            .docker
            .inspect_container(&container_name(run_id), None)
            .await
        {
            Ok(info) if self.owns(&info, run_id) => Ok(Some(info)),
            Ok(_) => Ok(None),
            Err(e) if status_of(&e) == Some(404) => Ok(None),
            Err(e) => Err(self.engine_error(run_id, "inspect the container", e)),
        }
    }

    fn owns(&self, info: &ContainerInspectResponse, run_id: &str) -> bool {
        let labels = info.config.as_ref().and_then(|c| c.labels.as_ref());
        labels.is_some_and(|l| {
            l.get(LABEL_RUN).map(String::as_str) == Some(run_id)
                && l.get(LABEL_AGENT) == Some(&self.agent)
        })
    }

    fn engine_error(&self, run_id: &str, what: &str, e: ApiError) -> RuntimeError {
        RuntimeError::Refused {
            run_id: run_id.to_string(),
            reason: format!("the Docker engine could not {what}: {}", describe(&e)),
        }
    }

    /// Pulls `image`; a stalled pull is abandoned.
    async fn pull(
        &self,
        run_id: &str,
        image: &ImageRef,
        auth: Option<&RegistryAuth>,
    ) -> Result<(), RuntimeError> {
        let reference = image.to_string();
        let refused = |reason: String| RuntimeError::Refused {
            run_id: run_id.to_string(),
            reason,
        };
        // bollard encodes its credentials header as standard base64 while the engine decodes
        // base64url (and then silently pulls without them), so the header is ours: set on a
        // client used for this one request, gone with it.
        let docker = match auth {
            None => self.docker.clone(),
            Some(auth) => engine::speaking(
                self.docker.clone(),
                Some(("X-Registry-Auth", registry_auth_header(auth, &image.host))),
            ),
        };
        let options = CreateImageOptions {
            from_image: Some(reference.clone()),
            ..Default::default()
        };
        let mut progress = docker.create_image(Some(options), None, None);
        loop {
            match tokio::time::timeout(self.pull_stall, progress.next()).await {
                Err(_) => {
                    return Err(refused(format!(
                        "the pull of {reference} made no progress for {} s and was abandoned; check that the node reaches {}",
                        self.pull_stall.as_secs_f64(),
                        image.host
                    )));
                }
                Ok(None) => return Ok(()),
                Ok(Some(Ok(_))) => {}
                Ok(Some(Err(e))) => {
                    let hint = if auth.is_some() {
                        "check the image and the credential given with it"
                    } else {
                        "check the image, and give a credential if the registry needs one"
                    };
                    return Err(refused(format!(
                        "cannot pull {reference}: {}; {hint}",
                        describe(&e)
                    )));
                }
            }
        }
    }

    fn create_body(
        &self,
        spec: &RunSpec,
        image: &ImageRef,
        argv: Vec<String>,
    ) -> ContainerCreateBody {
        let r = &spec.resources;
        let millis = |d: Duration| d.as_millis().to_string();
        let mut labels = HashMap::from([
            (LABEL_RUN.to_string(), spec.run_id.clone()),
            (LABEL_AGENT.to_string(), self.agent.clone()),
            (
                LABEL_GRACE_MS.to_string(),
                millis(spec.grace.unwrap_or(DEFAULT_GRACE)),
            ),
        ]);
        if let Some(timeout) = spec.timeout {
            labels.insert(LABEL_TIMEOUT_MS.into(), millis(timeout));
        }
        if let Some(limit) = spec.output_limit {
            labels.insert(LABEL_OUTPUT_LIMIT.into(), limit.to_string());
        }
        let memory = r.memory_bytes.map(|m| m as i64);
        let gpus = match &r.gpus {
            Gpus::None => None,
            Gpus::All => Some(DeviceRequest {
                count: Some(-1),
                capabilities: Some(vec![vec!["gpu".into()]]),
                ..Default::default()
            }),
            Gpus::Ids(ids) => Some(DeviceRequest {
                device_ids: Some(ids.clone()),
                capabilities: Some(vec![vec!["gpu".into()]]),
                ..Default::default()
            }),
        };
        ContainerCreateBody {
            image: Some(image.to_string()),
            // No arguments: the image's own command.
            cmd: (!argv.is_empty()).then_some(argv),
            env: Some(spec.env.iter().map(|(k, v)| format!("{k}={v}")).collect()),
            working_dir: Some(RUN_DIR.into()),
            labels: Some(labels),
            host_config: Some(HostConfig {
                init: Some(true),
                memory,
                // No swap beyond the limit, so the limit is what the kernel enforces.
                memory_swap: memory,
                nano_cpus: r.cpu_millis.map(|m| (m * 1_000_000) as i64),
                pids_limit: r.pids.map(|p| p as i64),
                device_requests: gpus.map(|g| vec![g]),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    async fn start_async(
        &self,
        spec: &RunSpec,
        image: &ImageRef,
        argv: Vec<String>,
    ) -> Result<Started, RuntimeError> {
        let run_id = spec.run_id.as_str();
        let name = container_name(run_id);
        let refused = |reason: String| RuntimeError::Refused {
            run_id: run_id.to_string(),
            reason,
        };
        // The create is asked first, as the `docker` CLI does: a container of this name (a
        // redelivered start) and a missing image are learned from its refusal, so the start of
        // a present image is two requests. At most one pull, and one retry after a container
        // created but never started (the agent died between the two) is removed, since its
        // inputs may be missing.
        let (mut pulled, mut retried) = (false, false);
        loop {
            let options = CreateContainerOptions {
                name: Some(name.clone()),
                ..Default::default()
            };
            let body = self.create_body(spec, image, argv.clone());
            let id = match self.docker.create_container(Some(options), body).await {
                Ok(created) => created.id,
                // The name is taken: by this run (adopted) or by another.
                Err(e) if status_of(&e) == Some(409) => {
                    if let Some(existing) = self.adopt(run_id).await? {
                        return Ok(existing);
                    }
                    if retried {
                        return Err(refused(format!(
                            "the container name {name} is taken by a container that is not this agent's run {run_id}; remove that container or use another run id"
                        )));
                    }
                    retried = true;
                    continue;
                }
                // No such image.
                Err(e) if status_of(&e) == Some(404) && !pulled => {
                    self.pull(run_id, image, spec.registry_auth.as_ref())
                        .await?;
                    pulled = true;
                    continue;
                }
                Err(e) => return Err(self.engine_error(run_id, "create the container", e)),
            };
            self.mark_image_used(&image.to_string(), pulled);
            if let Err(e) = self.launch(spec, &name).await {
                let _ = self.remove(&name).await;
                return Err(e);
            }
            // Set from now, a little after the engine's start: never early.
            if let Some(timeout) = spec.timeout {
                let grace = spec.grace.unwrap_or(DEFAULT_GRACE);
                self.timers.arm(run_id, &id, grace, timeout);
            }
            return Ok(Started::New);
        }
    }

    /// The run's container if it exists and ever started; a created, never started one is
    /// removed so the start can make it again.
    async fn adopt(&self, run_id: &str) -> Result<Option<Started>, RuntimeError> {
        let Some(info) = self.inspect(run_id).await? else {
            return Ok(None);
        };
        let state = info.state.as_ref().and_then(|s| s.status);
        if state == Some(ContainerStateStatusEnum::CREATED) {
            self.remove(&container_name(run_id))
                .await
                .map_err(|e| self.engine_error(run_id, "remove a half-made container", e))?;
            return Ok(None);
        }
        Ok(Some(Started::Already))
    }

    async fn remove(&self, name: &str) -> Result<(), ApiError> {
        let options = RemoveContainerOptions {
            force: true,
            ..Default::default()
        };
        self.docker.remove_container(name, Some(options)).await
    }

    /// Copies the inputs into the run folder, then starts the container.
    async fn launch(&self, spec: &RunSpec, name: &str) -> Result<(), RuntimeError> {
        let run_id = spec.run_id.as_str();
        if !spec.inputs.is_empty() {
            let unreadable = |e: std::io::Error| RuntimeError::Refused {
                run_id: run_id.to_string(),
                reason: format!("cannot read the inputs: {e}"),
            };
            let (tar, writing) = inputs_tar(&spec.inputs).map_err(unreadable)?;
            let options = UploadToContainerOptions {
                path: "/".into(),
                ..Default::default()
            };
            let uploaded = self
                .docker
                .upload_to_container(name, Some(options), bollard::body_try_stream(tar))
                .await;
            let written = writing
                .await
                .unwrap_or_else(|e| Err(std::io::Error::other(e)));
            match (uploaded, written) {
                // A closed pipe is the writer seeing the upload end; the upload says why.
                (_, Err(e)) if e.kind() != std::io::ErrorKind::BrokenPipe => {
                    return Err(unreadable(e));
                }
                (Err(e), _) => {
                    return Err(self.engine_error(run_id, "copy the inputs into /run", e));
                }
                (Ok(()), _) => {}
            }
        }
        match self.docker.start_container(name, None).await {
            Ok(()) => Ok(()),
            Err(e)
                if spec.resources.gpus != Gpus::None && describe(&e).contains("device driver") =>
            {
                Err(RuntimeError::Unsupported {
                    run_id: run_id.to_string(),
                    what: format!("a GPU request (the engine says: {})", describe(&e)),
                    runtime: NAME,
                    hint: "install the NVIDIA Container Toolkit on this node, or run without GPUs",
                })
            }
            Err(e) => Err(self.engine_error(run_id, "start the container", e)),
        }
    }

    /// Stops the container with its grace, having first recorded why.
    async fn end(
        &self,
        run_id: &str,
        info: &ContainerInspectResponse,
        mark: Mark,
    ) -> Result<(), RuntimeError> {
        self.set_mark(run_id, mark)?;
        stop_with_grace(&self.docker, &container_name(run_id), grace_of(info))
            .await
            .map_err(|e| self.engine_error(run_id, "stop the container", e))
    }

    /// The run as the engine has it now; a running run with a timeout gets its timer (one
    /// adopted after a restart), which stops it at once when it is past its deadline.
    async fn observe(&self, run_id: &str) -> Result<RunStatus, RuntimeError> {
        if let Some(done) = self.finished.lock().expect("not poisoned").get(run_id) {
            return Ok(done.clone());
        }
        let unknown = || RuntimeError::UnknownRun {
            run_id: run_id.to_string(),
        };
        let info = self.inspect(run_id).await?.ok_or_else(unknown)?;
        if is_running(&info)
            && let (Some(left), Some(id)) = (time_left(&info), info.id.as_deref())
        {
            self.timers.arm(run_id, id, grace_of(&info), left);
        }
        let status = self.status_from(run_id, &info).await?;
        if status.state.is_final() {
            self.finished
                .lock()
                .expect("not poisoned")
                .insert(run_id.to_string(), status.clone());
        }
        Ok(status)
    }

    async fn status_from(
        &self,
        run_id: &str,
        info: &ContainerInspectResponse,
    ) -> Result<RunStatus, RuntimeError> {
        let state = info.state.clone().unwrap_or_default();
        let status = state.status.unwrap_or(ContainerStateStatusEnum::EMPTY);
        let detail = serde_json::json!({
            "container": info.id,
            "name": container_name(run_id),
            "image": info.config.as_ref().and_then(|c| c.image.clone()),
            "engine_state": status.to_string(),
            "engine": self.engine_version,
        });
        let (run_state, error) = match status {
            ContainerStateStatusEnum::CREATED | ContainerStateStatusEnum::EMPTY => {
                (RunState::Starting, None)
            }
            ContainerStateStatusEnum::EXITED => (RunState::Finished, None),
            ContainerStateStatusEnum::DEAD => (
                RunState::Failed,
                Some(format!(
                    "the engine marked the container dead{}",
                    state
                        .error
                        .as_deref()
                        .filter(|e| !e.is_empty())
                        .map(|e| format!(": {e}"))
                        .unwrap_or_default()
                )),
            ),
            _ => (RunState::Running, None),
        };
        let outcome = if run_state.is_final() {
            let limit = label(info, LABEL_OUTPUT_LIMIT);
            let (stdout, stderr) = self.outputs(run_id, limit).await?;
            Some(Outcome {
                exit_code: state.exit_code.map(|c| c as i32),
                // The engine's init turns a signal into 128 plus its number; it is not told apart.
                signal: None,
                timed_out: self.marked(run_id, Mark::TimedOut),
                stopped: self.marked(run_id, Mark::Stopped),
                oom_killed: state.oom_killed,
                stdout: Some(stdout),
                stderr: Some(stderr),
                started_at: state.started_at.clone(),
                ended_at: state.finished_at.clone(),
            })
        } else {
            None
        };
        Ok(RunStatus {
            run_id: run_id.to_string(),
            state: run_state,
            report: RunReport {
                outcome,
                error,
                detail,
            },
        })
    }

    /// Both output streams as they ended: counted and hashed in full, the end kept.
    async fn outputs(
        &self,
        run_id: &str,
        limit: Option<u64>,
    ) -> Result<(OutputEnd, OutputEnd), RuntimeError> {
        let options = LogsOptions {
            stdout: true,
            stderr: true,
            ..Default::default()
        };
        let mut logs = self.docker.logs(&container_name(run_id), Some(options));
        let (mut out, mut err) = (StreamEnd::default(), StreamEnd::default());
        while let Some(chunk) = logs.next().await {
            match chunk.map_err(|e| self.engine_error(run_id, "read the run's output", e))? {
                bollard::container::LogOutput::StdErr { message } => err.push(&message),
                other => out.push(other.as_ref()),
            }
        }
        Ok((out.end(limit), err.end(limit)))
    }

    /// This agent's containers, as the engine lists them (no inspect).
    async fn containers(&self) -> Result<Vec<bollard::models::ContainerSummary>, RuntimeError> {
        let options = ListContainersOptions {
            all: true,
            filters: Some(HashMap::from([(
                "label".to_string(),
                vec![format!("{LABEL_AGENT}={}", self.agent)],
            )])),
            ..Default::default()
        };
        self.docker
            .list_containers(Some(options))
            .await
            .map_err(|e| RuntimeError::Failed {
                what: "listing containers".into(),
                reason: describe(&e),
            })
    }

    /// Removes a run's container and everything this runtime kept about it.
    async fn forget(&self, run_id: &str) -> Result<(), RuntimeError> {
        match self.remove(&container_name(run_id)).await {
            Ok(()) => {}
            Err(e) if status_of(&e) == Some(404) => {}
            Err(e) => return Err(self.engine_error(run_id, "remove the container", e)),
        }
        for mark in [Mark::Stopped, Mark::TimedOut] {
            let _ = std::fs::remove_file(self.mark_path(run_id, mark));
        }
        self.finished.lock().expect("not poisoned").remove(run_id);
        self.timers
            .armed
            .lock()
            .expect("not poisoned")
            .remove(run_id);
        Ok(())
    }

    async fn tidy_async(
        &self,
        record: &dyn Fn(&str) -> Option<RunState>,
    ) -> Result<Vec<String>, RuntimeError> {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs() as i64;
        let mut containers = self.containers().await?;
        // Newest first, so retention keeps the head of the list.
        containers.sort_by_key(|c| std::cmp::Reverse(c.created.unwrap_or(0)));
        let mut removed = Vec::new();
        let mut finished = 0;
        for c in containers {
            let Some(run_id) = c.labels.as_ref().and_then(|l| l.get(LABEL_RUN)).cloned() else {
                continue;
            };
            let age = Duration::from_secs((now - c.created.unwrap_or(now)).max(0) as u64);
            let why = match record(&run_id) {
                None if age >= self.tidy.stray_grace => {
                    format!(
                        "no run record on this node knows run {run_id} (a crash between create and record) after {} s",
                        self.tidy.stray_grace.as_secs()
                    )
                }
                None => continue,
                Some(state) if state.is_final() => {
                    finished += 1;
                    if finished <= self.tidy.keep_finished {
                        continue;
                    }
                    format!(
                        "only the newest {} finished runs keep their containers",
                        self.tidy.keep_finished
                    )
                }
                Some(_) => continue,
            };
            self.forget(&run_id).await?;
            tracing::info!(run_id = %run_id, "removed the container {}: {why}", container_name(&run_id));
            removed.push(run_id);
        }
        self.tidy_images().await?;
        Ok(removed)
    }

    /// Removes the images this runtime pulled that none of this agent's containers uses and that
    /// were last started `image_delay` ago; one in use by anything else stays.
    async fn tidy_images(&self) -> Result<(), RuntimeError> {
        let Ok(marks) = std::fs::read_dir(self.marks.join("images")) else {
            return Ok(());
        };
        let in_use: std::collections::HashSet<String> = self
            .containers()
            .await?
            .into_iter()
            .filter_map(|c| c.image)
            .collect();
        for mark in marks.flatten() {
            let path = mark.path();
            let Ok(image) = std::fs::read_to_string(&path) else {
                continue;
            };
            let idle = mark
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .unwrap_or_default();
            if in_use.contains(&image) || idle < self.tidy.image_delay {
                continue;
            }
            let options = bollard::query_parameters::RemoveImageOptions::default();
            match self.docker.remove_image(&image, Some(options), None).await {
                Ok(_) => tracing::info!(
                    "removed the image {image}: no run of this agent used it for {} s",
                    idle.as_secs()
                ),
                Err(e) if status_of(&e) == Some(404) => {}
                // Another container (not this agent's) uses it: it stays, and so does the mark.
                Err(e) if status_of(&e) == Some(409) => continue,
                Err(e) => {
                    return Err(RuntimeError::Failed {
                        what: format!("removing the unused image {image}"),
                        reason: describe(&e),
                    });
                }
            }
            let _ = std::fs::remove_file(&path);
        }
        Ok(())
    }

    async fn list_async(&self) -> Result<Vec<RunStatus>, RuntimeError> {
        let containers = self.containers().await?;
        let mut runs = Vec::new();
        for c in containers {
            let Some(run_id) = c.labels.as_ref().and_then(|l| l.get(LABEL_RUN)) else {
                continue;
            };
            match self.observe(run_id).await {
                Ok(status) => runs.push(status),
                // Removed between the list and the inspect.
                Err(RuntimeError::UnknownRun { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(runs)
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
        let run_id = &spec.run_id;
        let unsupported = |what: String, hint| RuntimeError::Unsupported {
            run_id: run_id.clone(),
            what,
            runtime: NAME,
            hint,
        };
        let image = match &spec.workload {
            Workload::Image(image) => image.clone(),
            Workload::Program(_) => {
                return Err(unsupported(
                    "a staged program".into(),
                    "run programs on the process runtime",
                ));
            }
        };
        run_store::RunId::parse(run_id).map_err(|e| RuntimeError::Refused {
            run_id: run_id.clone(),
            reason: e.to_string(),
        })?;
        let mut argv = Vec::with_capacity(spec.argv.len());
        for (n, arg) in spec.argv.iter().enumerate() {
            let Some(text) = arg.to_str() else {
                return Err(unsupported(
                    format!("argument {} (not UTF-8)", n + 1),
                    "the Engine API carries arguments as text; pass UTF-8 or run it as a program",
                ));
            };
            argv.push(text.to_string());
        }
        self.rt().block_on(self.start_async(spec, &image, argv))
    }

    fn stop(&self, run_id: &str) -> Result<(), RuntimeError> {
        self.rt().block_on(async {
            let info = self
                .inspect(run_id)
                .await?
                .ok_or_else(|| RuntimeError::UnknownRun {
                    run_id: run_id.to_string(),
                })?;
            if is_running(&info) {
                self.end(run_id, &info, Mark::Stopped).await?;
            }
            Ok(())
        })
    }

    fn status(&self, run_id: &str) -> Result<RunStatus, RuntimeError> {
        self.rt().block_on(self.observe(run_id))
    }

    fn collect(
        &self,
        run_id: &str,
        path: &str,
        max_bytes: u64,
        sink: &mut dyn std::io::Write,
    ) -> Result<Collected, RuntimeError> {
        collect::collect(self, run_id, path, max_bytes, sink)
    }

    fn list(&self) -> Result<Vec<RunStatus>, RuntimeError> {
        self.rt().block_on(self.list_async())
    }

    fn tidy(&self, record: &dyn Fn(&str) -> Option<RunState>) -> Result<Vec<String>, RuntimeError> {
        {
            let mut last = self.last_tidy.lock().expect("not poisoned");
            if last.is_some_and(|at| at.elapsed() < self.tidy.every) {
                return Ok(Vec::new());
            }
            *last = Some(std::time::Instant::now());
        }
        self.rt().block_on(self.tidy_async(record))
    }
}

/// The engine's stop: SIGTERM, then a kill once `grace` is out; returns once the container
/// has ended. Stopping a stopped container is no error.
async fn stop_with_grace(
    docker: &Docker,
    container: &str,
    grace: Duration,
) -> Result<(), ApiError> {
    let options = StopContainerOptions {
        t: Some(grace.as_secs_f64().ceil() as i32),
        ..Default::default()
    };
    match docker.stop_container(container, Some(options)).await {
        Err(e) if status_of(&e) == Some(304) => Ok(()),
        other => other,
    }
}

/// The run's grace, from its label.
fn grace_of(info: &ContainerInspectResponse) -> Duration {
    label(info, LABEL_GRACE_MS)
        .map(Duration::from_millis)
        .unwrap_or(DEFAULT_GRACE)
}

fn is_running(info: &ContainerInspectResponse) -> bool {
    info.state.as_ref().and_then(|s| s.running) == Some(true)
}

/// What is left of a running container's timeout (zero once past it), by the engine's start
/// time; `None` without a timeout.
fn time_left(info: &ContainerInspectResponse) -> Option<Duration> {
    let timeout = Duration::from_millis(label(info, LABEL_TIMEOUT_MS)?);
    let started = info.state.as_ref()?.started_at.as_deref()?;
    let ran = std::time::SystemTime::now()
        .duration_since(time::parse_rfc3339(started)?)
        .unwrap_or_default();
    Some(timeout.saturating_sub(ran))
}

/// Timeouts enforced at their deadline by a timer on the client's own thread, so a run ends on
/// time whoever observes it, and whoever observes (the agent's watch, beside its heartbeats)
/// never waits for a stop's grace.
struct Timers {
    docker: Docker,
    marks: PathBuf,
    changes: Changes,
    /// Runs whose timer is set: at most one each.
    armed: Mutex<HashSet<String>>,
}

impl Timers {
    /// Once per run: in `left`, the container `id`, if still running, is stopped with `grace`,
    /// its timeout recorded first; then the run is noted as changed.
    fn arm(self: &Arc<Self>, run_id: &str, id: &str, grace: Duration, left: Duration) {
        if !self
            .armed
            .lock()
            .expect("not poisoned")
            .insert(run_id.to_string())
        {
            return;
        }
        let (timers, run, id) = (self.clone(), run_id.to_string(), id.to_string());
        tokio::spawn(async move {
            tokio::time::sleep(left).await;
            if let Err(e) = timers.expire(&run, &id, grace).await {
                tracing::warn!(run_id = %run, "cannot stop the timed-out container: {e}");
            }
            timers.changes.note(&run);
        });
    }

    async fn expire(&self, run_id: &str, id: &str, grace: Duration) -> Result<(), String> {
        match self.docker.inspect_container(id, None).await {
            Ok(info) if is_running(&info) => {}
            // It ended on its own, or is gone.
            Ok(_) => return Ok(()),
            Err(e) if status_of(&e) == Some(404) => return Ok(()),
            Err(e) => return Err(describe(&e)),
        }
        // The stop goes ahead even if the reason cannot be recorded: the timeout is the promise.
        if let Err(e) = set_mark(&self.marks, run_id, Mark::TimedOut) {
            tracing::warn!("{e}");
        }
        stop_with_grace(&self.docker, id, grace)
            .await
            .map_err(|e| describe(&e))
    }
}

/// Notes every end of this agent's containers as the engine reports it (`die`); a cut stream
/// is opened again after [`EVENTS_RETRY`] (the agent's watch covers the gap).
async fn watch_events(docker: Docker, agent: String, changes: Changes) {
    let options = EventsOptions {
        filters: Some(HashMap::from([
            ("type".to_string(), vec!["container".to_string()]),
            ("event".to_string(), vec!["die".to_string()]),
            ("label".to_string(), vec![format!("{LABEL_AGENT}={agent}")]),
        ])),
        ..Default::default()
    };
    loop {
        let mut events = docker.events(Some(options.clone()));
        while let Some(Ok(event)) = events.next().await {
            let attributes = event.actor.and_then(|a| a.attributes);
            if let Some(run_id) = attributes.as_ref().and_then(|a| a.get(LABEL_RUN)) {
                changes.note(run_id);
            }
        }
        tokio::time::sleep(EVENTS_RETRY).await;
    }
}

fn mark_path(marks: &Path, run_id: &str, mark: Mark) -> PathBuf {
    marks.join(format!("{run_id}.{}", mark.file()))
}

fn set_mark(marks: &Path, run_id: &str, mark: Mark) -> Result<(), RuntimeError> {
    let path = mark_path(marks, run_id, mark);
    std::fs::create_dir_all(marks)
        .and_then(|()| std::fs::write(&path, b""))
        .map_err(|e| RuntimeError::Refused {
            run_id: run_id.to_string(),
            reason: format!(
                "cannot record why the run ends in {}: {e}; check the agent's state folder",
                path.display()
            ),
        })
}

fn label(info: &ContainerInspectResponse, name: &str) -> Option<u64> {
    let labels = info.config.as_ref()?.labels.as_ref()?;
    labels.get(name)?.parse().ok()
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

/// `X-Registry-Auth`: the credential as JSON, in base64url (what the engine decodes).
fn registry_auth_header(auth: &RegistryAuth, host: &str) -> http::HeaderValue {
    use base64::Engine as _;
    let json = serde_json::json!({
        "username": auth.username,
        "password": auth.password,
        "serveraddress": host,
    });
    let encoded = base64::engine::general_purpose::URL_SAFE.encode(json.to_string());
    let mut value = http::HeaderValue::from_str(&encoded).expect("base64url is a header value");
    value.set_sensitive(true);
    value
}

/// The size of the chunks the inputs' tar is sent in; a few are in flight at most.
const TAR_CHUNK: usize = 64 << 10;

/// The inputs as a tar of `run/NAME` entries (unpacked at the container's root), written by a
/// blocking task into a stream of a few [`TAR_CHUNK`]s in flight, so memory stays flat
/// whatever their size. Every file is opened first: a missing one is refused before anything
/// is sent. The task's result says whether the whole tar was written.
fn inputs_tar(
    inputs: &[(String, PathBuf)],
) -> std::io::Result<(
    impl futures_util::Stream<Item = std::io::Result<bytes::Bytes>> + Send + 'static,
    tokio::task::JoinHandle<std::io::Result<()>>,
)> {
    let files = inputs
        .iter()
        .map(|(name, path)| {
            let named = |e: std::io::Error| {
                std::io::Error::new(e.kind(), format!("{}: {e}", path.display()))
            };
            let file = std::fs::File::open(path).map_err(named)?;
            let size = file.metadata().map_err(named)?.len();
            Ok((name.clone(), path.clone(), file, size))
        })
        .collect::<std::io::Result<Vec<_>>>()?;
    let (chunks, body) = tokio::sync::mpsc::channel::<std::io::Result<bytes::Bytes>>(4);
    let failed = chunks.clone();
    let writing = tokio::task::spawn_blocking(move || {
        let written = write_inputs(files, ChunkSender(chunks));
        if let Err(e) = &written {
            // Ends the request with an error, so the engine never unpacks a cut tar.
            let _ = failed.blocking_send(Err(std::io::Error::new(e.kind(), e.to_string())));
        }
        written
    });
    let body = futures_util::stream::unfold(body, |mut body| async move {
        body.recv().await.map(|chunk| (chunk, body))
    });
    Ok((body, writing))
}

fn write_inputs(
    files: Vec<(String, PathBuf, std::fs::File, u64)>,
    sink: ChunkSender,
) -> std::io::Result<()> {
    use std::io::{Read as _, Write as _};
    let mut tar = tar::Builder::new(std::io::BufWriter::with_capacity(TAR_CHUNK, sink));
    let mut dir = tar::Header::new_gnu();
    dir.set_entry_type(tar::EntryType::Directory);
    dir.set_mode(0o755);
    dir.set_size(0);
    tar.append_data(&mut dir, "run/", std::io::empty())?;
    for (name, path, file, size) in files {
        let mut header = tar::Header::new_gnu();
        header.set_mode(0o644);
        header.set_size(size);
        let mut data = file.take(size);
        tar.append_data(&mut header, format!("run/{name}"), &mut data)?;
        if data.limit() > 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!("{} shrank while it was being sent", path.display()),
            ));
        }
    }
    tar.into_inner()?.flush()
}

/// A writer into the upload's stream of chunks; a closed stream (the upload ended) is a broken
/// pipe.
struct ChunkSender(tokio::sync::mpsc::Sender<std::io::Result<bytes::Bytes>>);

impl std::io::Write for ChunkSender {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .blocking_send(Ok(bytes::Bytes::copy_from_slice(buf)))
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "the upload ended"))?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// One output stream being read: counted and hashed in full, its last KiB kept.
#[derive(Default)]
struct StreamEnd {
    bytes: u64,
    hash: sha2::Sha256,
    last: Vec<u8>,
}

impl StreamEnd {
    const LAST: usize = 1024;

    fn push(&mut self, chunk: &[u8]) {
        self.bytes += chunk.len() as u64;
        self.hash.update(chunk);
        self.last.extend_from_slice(chunk);
        if self.last.len() > Self::LAST {
            self.last.drain(..self.last.len() - Self::LAST);
        }
    }

    fn end(self, limit: Option<u64>) -> OutputEnd {
        let kept = limit.map_or(self.bytes, |l| l.min(self.bytes));
        let digest = format!("sha256:{}", hex::encode(self.hash.finalize()));
        OutputEnd {
            bytes: self.bytes,
            kept,
            truncated: kept < self.bytes,
            sha256: fleet_proto::Digest::parse(&digest).expect("a sha256 digest"),
            last: run_store::Bytes(self.last),
        }
    }
}
