//! [`Routed`]: the agent's one runtime over both kinds of work, so runs on one node can mix
//! programs and images. A start goes by its workload (a program to the process runtime, an
//! image to the Docker one); every other call goes where the run lives: the run store first
//! (a file read), then the engine's labelled containers.
//!
//! The engine is reached when the agent starts and, if it did not answer, again when an image
//! or a lookup needs it (at most every [`RETRY`]), so an engine started after the agent is
//! picked up; until then programs run and images are refused with one line.
use super::docker::{DockerRuntime, EngineAddress};
use super::{
    Changes, Collected, ProcessRuntime, RunSpec, RunStatus, Runtime, RuntimeError, Started,
    Workload,
};
use fleet_proto::RunId;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The least time between two attempts to reach an engine that did not answer.
pub const RETRY: Duration = Duration::from_secs(10);

/// Why there is no Docker runtime, in one line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct NoEngine(String);

pub struct Routed {
    process: ProcessRuntime,
    address: EngineAddress,
    marks: PathBuf,
    agent: String,
    docker: Mutex<Engine>,
    /// The engine's runtime notes here, whenever it is reached.
    changes: Changes,
}

enum Engine {
    Ready(Arc<DockerRuntime>),
    /// Why the last attempt failed, and when it was.
    Missing {
        reason: String,
        at: Instant,
    },
}

impl Routed {
    /// Both runtimes; the engine at `address` is tried now. `marks` is the Docker runtime's
    /// folder, `agent` the label its containers carry.
    pub fn new(
        process: ProcessRuntime,
        address: EngineAddress,
        marks: &Path,
        agent: &str,
    ) -> Routed {
        let changes = Changes::default();
        let docker = Mutex::new(connect(&address, marks, agent, &changes));
        Routed {
            process,
            address,
            marks: marks.to_path_buf(),
            agent: agent.to_string(),
            docker,
            changes,
        }
    }

    /// The Docker runtime, or the one line saying why there is none.
    pub fn docker(&self) -> Result<Arc<DockerRuntime>, NoEngine> {
        self.docker_line().map_err(NoEngine)
    }

    fn docker_line(&self) -> Result<Arc<DockerRuntime>, String> {
        let mut engine = self
            .docker
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Engine::Missing { at, .. } = &*engine
            && at.elapsed() >= RETRY
        {
            *engine = connect(&self.address, &self.marks, &self.agent, &self.changes);
        }
        match &*engine {
            Engine::Ready(docker) => Ok(docker.clone()),
            Engine::Missing { reason, .. } => Err(reason.clone()),
        }
    }

    /// Runs `call` on the runtime holding `run_id`: the run store's, else the engine's.
    fn routed<T>(
        &self,
        run_id: &RunId,
        call: impl Fn(&dyn Runtime) -> Result<T, RuntimeError>,
    ) -> Result<T, RuntimeError> {
        match call(&self.process) {
            Err(RuntimeError::UnknownRun { .. }) => match self.docker() {
                Ok(docker) => call(docker.as_ref()),
                Err(_) => Err(RuntimeError::UnknownRun {
                    run_id: run_id.clone(),
                }),
            },
            other => other,
        }
    }
}

fn connect(address: &EngineAddress, marks: &Path, agent: &str, changes: &Changes) -> Engine {
    match DockerRuntime::connect(address, marks, agent, changes.clone()) {
        Ok(docker) => {
            tracing::info!(engine = %docker.engine_version(), address = %address.describe(), "Docker engine reached; images run as containers");
            Engine::Ready(Arc::new(docker))
        }
        Err(e) => {
            tracing::info!("{e}; programs run, images are refused until the engine answers");
            Engine::Missing {
                reason: e.to_string(),
                at: Instant::now(),
            }
        }
    }
}

impl Runtime for Routed {
    fn stage(&self, file: &Path) -> Result<fleet_proto::Digest, RuntimeError> {
        self.process.stage(file)
    }

    fn start(&self, spec: &RunSpec) -> Result<Started, RuntimeError> {
        match &spec.workload {
            Workload::Program(_) => self.process.start(spec),
            Workload::Image(_) => match self.docker() {
                Ok(docker) => docker.start(spec),
                Err(reason) => Err(RuntimeError::NoEngine {
                    run_id: spec.run_id.clone(),
                    reason: reason.to_string(),
                }),
            },
        }
    }

    fn stop(&self, run_id: &RunId) -> Result<(), RuntimeError> {
        self.routed(run_id, |rt| rt.stop(run_id))
    }

    fn status(&self, run_id: &RunId) -> Result<RunStatus, RuntimeError> {
        self.routed(run_id, |rt| rt.status(run_id))
    }

    fn collect(
        &self,
        run_id: &RunId,
        path: &str,
        max_bytes: u64,
        sink: &mut dyn std::io::Write,
    ) -> Result<Collected, RuntimeError> {
        // The sink is written only by the runtime that holds the run (an unknown run writes nothing).
        match self.process.collect(run_id, path, max_bytes, sink) {
            Err(RuntimeError::UnknownRun { .. }) => match self.docker() {
                Ok(docker) => docker.collect(run_id, path, max_bytes, sink),
                Err(_) => Err(RuntimeError::UnknownRun {
                    run_id: run_id.clone(),
                }),
            },
            other => other,
        }
    }

    fn open_collected(
        &self,
        run_id: &RunId,
        path: &str,
        max_bytes: u64,
        scratch: &Path,
    ) -> Result<super::CollectedFile, RuntimeError> {
        self.routed(run_id, |rt| {
            rt.open_collected(run_id, path, max_bytes, scratch)
        })
    }

    fn tidy(
        &self,
        record: &dyn Fn(&RunId) -> Option<super::RunState>,
    ) -> Result<Vec<RunId>, RuntimeError> {
        let mut removed = self.process.tidy(record)?;
        // Only an engine already reached is tidied: tidying never retries a missing one.
        let docker = match &*self
            .docker
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
        {
            Engine::Ready(docker) => Some(docker.clone()),
            Engine::Missing { .. } => None,
        };
        if let Some(docker) = docker {
            removed.extend(docker.tidy(record)?);
        }
        Ok(removed)
    }

    fn changes(&self) -> Option<Changes> {
        Some(self.changes.clone())
    }

    fn list(&self) -> Result<Vec<RunStatus>, RuntimeError> {
        let mut runs = self.process.list()?;
        if let Ok(docker) = self.docker() {
            runs.extend(docker.list()?);
        }
        Ok(runs)
    }

    fn held(&self) -> super::Held {
        let mut held = self.process.held();
        if let Ok(docker) = self.docker() {
            match docker.image_digests() {
                Ok(images) => {
                    held.images = images.len() as u64;
                    held.digests.extend(images);
                }
                Err(e) => tracing::debug!("the inventory leaves the engine's images out: {e}"),
            }
        }
        held
    }

    fn read_manifest(&self, image: &str) -> Result<fleet_proto::Digest, String> {
        let docker = self.docker().map_err(|why| format!("{image}: {why}"))?;
        docker.read_manifest(image).map_err(|e| e.to_string())
    }

    fn engine(&self) -> Option<fleet_proto::facts::EngineFacts> {
        let (reachable, version, api_version, error) = match self.docker() {
            Ok(docker) => {
                let v = docker.engine_version();
                (true, Some(v.version.clone()), Some(v.api.clone()), None)
            }
            Err(reason) => (false, None, None, Some(reason.to_string())),
        };
        Some(fleet_proto::facts::EngineFacts {
            name: "docker".into(),
            reachable,
            version,
            api_version,
            error,
        })
    }
}
