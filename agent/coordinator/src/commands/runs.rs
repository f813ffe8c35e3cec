//! The run commands: `run`, `status`, `collect`, `stop`, `replicate`, and which coordinators a
//! `run` pushes its content to while it imports it.
use super::{Context, Operation};
use crate::CoordinatorError;
use crate::push::CopyTargets;
use crate::runs::{Collected, ReplicateRequest, Replicated, RunRequest, RunView, SetView};
use serde::{Deserialize, Serialize};

/// `run`: the signature is checked against the registry first, the content is held by enough
/// coordinators of the fleet, then the set is recorded.
impl Operation for RunRequest {
    type Answer = SetView;

    async fn apply(self, at: &Context) -> Result<SetView, CoordinatorError> {
        let signed_by = at.coordinator().check_signature(&self).await?;
        if at.serving() {
            at.coordinator().spread(&self.content()).await?;
        }
        at.on_store(move |c, _| c.create_runs(&self, signed_by))
            .await
    }
}

/// `status [--set S] [--run R]`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Status {
    pub set: Option<String>,
    pub run: Option<String>,
}

impl Operation for Status {
    type Answer = Vec<RunView>;
    const READ_ONLY: bool = true;

    async fn apply(self, at: &Context) -> Result<Vec<RunView>, CoordinatorError> {
        at.on_store(move |c, _| c.status(self.set.as_deref(), self.run.as_deref()))
            .await
    }
}

/// `collect --run R --path P`: the node uploads the file into the blob store.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Collect {
    pub run: String,
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_bytes: Option<u64>,
}

impl Operation for Collect {
    type Answer = Collected;

    async fn apply(self, at: &Context) -> Result<Collected, CoordinatorError> {
        (at.coordinator())
            .collect(&self.run, &self.path, self.max_bytes)
            .await
    }
}

/// `stop --run R`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Stop {
    pub run: String,
}

impl Operation for Stop {
    type Answer = ();

    async fn apply(self, at: &Context) -> Result<(), CoordinatorError> {
        at.coordinator().stop(&self.run).await
    }
}

/// `replicate`: an artifact put in place on a node.
impl Operation for ReplicateRequest {
    type Answer = Replicated;

    async fn apply(self, at: &Context) -> Result<Replicated, CoordinatorError> {
        at.coordinator().replicate(&self).await
    }
}

/// Which coordinators `run` pushes its content to while it imports it: none where no
/// coordinator serves here.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct CopyTargetsOf {}

impl Operation for CopyTargetsOf {
    type Answer = CopyTargets;
    const READ_ONLY: bool = true;

    async fn apply(self, at: &Context) -> Result<CopyTargets, CoordinatorError> {
        Ok(match at.serving() {
            true => at.coordinator().copy_targets().await,
            false => CopyTargets::default(),
        })
    }
}
