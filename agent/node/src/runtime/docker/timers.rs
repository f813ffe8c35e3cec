//! Ending runs: an operator's stop, and the timers that stop a run at its timeout.
use super::marks::{Mark, set_mark};
use super::{
    Changes, DEFAULT_GRACE, DockerRuntime, LABEL_GRACE_MS, LABEL_TIMEOUT_MS, RuntimeError,
    container_name, describe, status_of, time,
};
use bollard::Docker;
use bollard::errors::Error as ApiError;
use bollard::models::ContainerInspectResponse;
use bollard::query_parameters::StopContainerOptions;
use fleet_proto::RunId;
use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

impl DockerRuntime {
    /// Stops the run's container if it is running, its stop recorded first.
    pub(super) async fn stop_async(&self, run_id: &RunId) -> Result<(), RuntimeError> {
        let info = self
            .inspect(run_id)
            .await?
            .ok_or_else(|| RuntimeError::UnknownRun {
                run_id: run_id.clone(),
            })?;
        if is_running(&info) {
            self.end(run_id, &info, Mark::Stopped).await?;
        }
        Ok(())
    }

    /// Stops the container with its grace, having first recorded why.
    async fn end(
        &self,
        run_id: &RunId,
        info: &ContainerInspectResponse,
        mark: Mark,
    ) -> Result<(), RuntimeError> {
        self.set_mark(run_id, mark)?;
        stop_with_grace(&self.docker, &container_name(run_id), grace_of(info))
            .await
            .map_err(|e| self.engine_error(run_id, "stop the container", e))
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
pub(super) fn grace_of(info: &ContainerInspectResponse) -> Duration {
    label(info, LABEL_GRACE_MS)
        .map(Duration::from_millis)
        .unwrap_or(DEFAULT_GRACE)
}

/// What is left of a running container's timeout (zero once past it), by the engine's start
/// time; `None` without a timeout.
pub(super) fn time_left(info: &ContainerInspectResponse) -> Option<Duration> {
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
pub(super) struct Timers {
    docker: Docker,
    marks: PathBuf,
    changes: Changes,
    /// Runs whose timer is set: at most one each.
    armed: Mutex<HashSet<RunId>>,
}

impl Timers {
    pub(super) fn new(docker: Docker, marks: PathBuf, changes: Changes) -> Timers {
        Timers {
            docker,
            marks,
            changes,
            armed: Mutex::new(HashSet::new()),
        }
    }

    /// Once per run: in `left`, the container `id`, if still running, is stopped with `grace`,
    /// its timeout recorded first; then the run is noted as changed.
    pub(super) fn arm(self: &Arc<Self>, run_id: &RunId, id: &str, grace: Duration, left: Duration) {
        if !self
            .armed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(run_id.clone())
        {
            return;
        }
        let (timers, run, id) = (self.clone(), run_id.clone(), id.to_string());
        tokio::spawn(async move {
            tokio::time::sleep(left).await;
            if let Err(e) = timers.expire(&run, &id, grace).await {
                tracing::warn!(run_id = %run, "cannot stop the timed-out container: {e}");
            }
            timers.changes.note(&run);
        });
    }

    /// Forgets that the run's timer is set (one set still fires), so it can be armed again.
    pub(super) fn disarm(&self, run_id: &RunId) {
        self.armed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(run_id);
    }

    async fn expire(&self, run_id: &RunId, id: &str, grace: Duration) -> Result<(), String> {
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

pub(super) fn is_running(info: &ContainerInspectResponse) -> bool {
    info.state.as_ref().and_then(|s| s.running) == Some(true)
}

pub(super) fn label(info: &ContainerInspectResponse, name: &str) -> Option<u64> {
    let labels = info.config.as_ref()?.labels.as_ref()?;
    labels.get(name)?.parse().ok()
}
