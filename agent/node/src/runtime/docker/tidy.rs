//! Clean-up: a run's container forgotten, strays and old finished runs ([`Tidy`]), unused images.
use super::marks::Mark;
use super::{
    DockerRuntime, LABEL_AGENT, RunState, RuntimeError, container_name, describe, labelled_run,
    status_of,
};
use bollard::errors::Error as ApiError;
use bollard::query_parameters::{ListContainersOptions, RemoveContainerOptions};
use fleet_proto::RunId;
use std::collections::HashMap;
use std::time::Duration;

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

impl DockerRuntime {
    pub(super) async fn remove(&self, name: &str) -> Result<(), ApiError> {
        let options = RemoveContainerOptions {
            force: true,
            ..Default::default()
        };
        self.docker.remove_container(name, Some(options)).await
    }

    /// This agent's containers, as the engine lists them (no inspect).
    pub(super) async fn containers(
        &self,
    ) -> Result<Vec<bollard::models::ContainerSummary>, RuntimeError> {
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
    async fn forget(&self, run_id: &RunId) -> Result<(), RuntimeError> {
        match self.remove(&container_name(run_id)).await {
            Ok(()) => {}
            Err(e) if status_of(&e) == Some(404) => {}
            Err(e) => return Err(self.engine_error(run_id, "remove the container", e)),
        }
        for mark in [Mark::Stopped, Mark::TimedOut] {
            let _ = std::fs::remove_file(self.mark_path(run_id, mark));
        }
        self.finished
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(run_id);
        self.timers.disarm(run_id);
        Ok(())
    }

    pub(super) async fn tidy_async(
        &self,
        record: &dyn Fn(&RunId) -> Option<RunState>,
    ) -> Result<Vec<RunId>, RuntimeError> {
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
            let Some(run_id) = labelled_run(c.labels.as_ref()) else {
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
}
