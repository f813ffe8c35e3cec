//! Reading runs from the engine: a run's container, its status and outcome, this agent's runs.
use super::marks::Mark;
use super::timers::{grace_of, is_running, label, time_left};
use super::{
    DockerRuntime, LABEL_AGENT, LABEL_OUTPUT_LIMIT, LABEL_RUN, RunState, RunStatus, RuntimeError,
    container_name, labelled_run, status_of,
};
use crate::runtime::{Outcome, RunReport};
use bollard::models::{ContainerInspectResponse, ContainerStateStatusEnum};
use bollard::query_parameters::LogsOptions;
use fleet_proto::RunId;
use fleet_proto::run::OutputEnd;
use futures_util::StreamExt;
use sha2::Digest as _;

impl DockerRuntime {
    /// The run's container, if this agent has one by that name.
    pub(super) async fn inspect(
        &self,
        run_id: &RunId,
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

    fn owns(&self, info: &ContainerInspectResponse, run_id: &RunId) -> bool {
        let labels = info.config.as_ref().and_then(|c| c.labels.as_ref());
        labels.is_some_and(|l| {
            l.get(LABEL_RUN).map(String::as_str) == Some(run_id.as_str())
                && l.get(LABEL_AGENT) == Some(&self.agent)
        })
    }

    /// The run as the engine has it now; a running run with a timeout gets its timer (one
    /// adopted after a restart), which stops it at once when it is past its deadline.
    pub(super) async fn observe(&self, run_id: &RunId) -> Result<RunStatus, RuntimeError> {
        if let Some(done) = self
            .finished
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(run_id)
        {
            return Ok(done.clone());
        }
        let unknown = || RuntimeError::UnknownRun {
            run_id: run_id.clone(),
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
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(run_id.clone(), status.clone());
        }
        Ok(status)
    }

    async fn status_from(
        &self,
        run_id: &RunId,
        info: &ContainerInspectResponse,
    ) -> Result<RunStatus, RuntimeError> {
        let state = info.state.clone().unwrap_or_default();
        let status = state.status.unwrap_or(ContainerStateStatusEnum::EMPTY);
        let detail = serde_json::json!({
            "container": info.id,
            "name": container_name(run_id),
            "image": info.config.as_ref().and_then(|c| c.image.clone()),
            "engine_state": status.to_string(),
            "engine": self.engine_version.to_string(),
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
            run_id: run_id.clone(),
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
        run_id: &RunId,
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

    pub(super) async fn list_async(&self) -> Result<Vec<RunStatus>, RuntimeError> {
        let containers = self.containers().await?;
        let mut runs = Vec::new();
        for c in containers {
            let Some(run_id) = labelled_run(c.labels.as_ref()) else {
                continue;
            };
            match self.observe(&run_id).await {
                Ok(status) => runs.push(status),
                // Removed between the list and the inspect.
                Err(RuntimeError::UnknownRun { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(runs)
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
            // Cannot fail: the digest was made above from the bytes' SHA-256.
            sha256: fleet_proto::Digest::parse(&digest).expect("a sha256 digest"),
            last: run_store::Bytes(self.last),
        }
    }
}
