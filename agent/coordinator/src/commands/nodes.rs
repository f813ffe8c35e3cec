//! The node commands: `nodes`, `check`, `drain`, `capacity`, `label`, `retire`/`revoke` and
//! `forget`. A change answers the node as it left it.
use super::{Context, Operation};
use crate::check::{CheckNodes, NodeChecks};
use crate::{CoordinatorError, NodeFilter, NodeView};
use fleet_proto::protocol::NodeEnd;
use serde::{Deserialize, Serialize};

/// `nodes [--state S] [--where EXPR]`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ListNodes {
    #[serde(default)]
    pub filter: NodeFilter,
}

impl Operation for ListNodes {
    type Answer = Vec<NodeView>;
    const READ_ONLY: bool = true;

    async fn apply(self, at: &Context) -> Result<Vec<NodeView>, CoordinatorError> {
        at.on_store(move |c, _| c.nodes_matching(&self.filter))
            .await
    }
}

/// `check --node N|--all`: each node's acceptance checks, through its session.
impl Operation for CheckNodes {
    type Answer = Vec<NodeChecks>;

    async fn apply(self, at: &Context) -> Result<Vec<NodeChecks>, CoordinatorError> {
        at.coordinator().check_nodes(&self).await
    }
}

/// `drain --node N [--undrain]`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Drain {
    pub node: String,
    pub undrain: bool,
}

impl Operation for Drain {
    type Answer = NodeView;

    async fn apply(self, at: &Context) -> Result<NodeView, CoordinatorError> {
        at.on_store(move |c, _| c.drain(&self.node, self.undrain))
            .await
    }
}

/// `capacity --node N (--runs K | --reset)`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Capacity {
    pub node: String,
    pub runs: Option<u32>,
}

impl Operation for Capacity {
    type Answer = NodeView;

    async fn apply(self, at: &Context) -> Result<NodeView, CoordinatorError> {
        at.on_store(move |c, _| c.set_capacity(&self.node, self.runs))
            .await
    }
}

/// `label --node N K=V... [--remove K]...`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Label {
    pub node: String,
    pub set: Vec<(String, String)>,
    pub remove: Vec<String>,
}

impl Operation for Label {
    type Answer = NodeView;

    async fn apply(self, at: &Context) -> Result<NodeView, CoordinatorError> {
        at.on_store(move |c, _| c.label(&self.node, &self.set, &self.remove))
            .await
    }
}

/// `retire --node N [--discard]` and `revoke --node N`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EndNode {
    pub node: String,
    pub end: NodeEnd,
    pub discard: bool,
}

/// A node retired or revoked, and how many of its runs ended lost with it.
#[derive(Debug, Serialize, Deserialize)]
pub struct Ended {
    pub node: NodeView,
    pub lost: u64,
}

impl Operation for EndNode {
    type Answer = Ended;

    async fn apply(self, at: &Context) -> Result<Ended, CoordinatorError> {
        let (node, lost) = at
            .on_store(move |c, _| c.end_node(&self.node, self.end, self.discard))
            .await?;
        Ok(Ended { node, lost })
    }
}

/// `forget --node N`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Forget {
    pub node: String,
}

impl Operation for Forget {
    type Answer = NodeView;

    async fn apply(self, at: &Context) -> Result<NodeView, CoordinatorError> {
        at.on_store(move |c, _| c.forget(&self.node)).await
    }
}
