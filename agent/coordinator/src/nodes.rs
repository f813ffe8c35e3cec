//! The fleet's machines as `fleet-coordinator nodes` shows them: joined or lost by their lease,
//! and machines that reported a failed bootstrap on their token.
use crate::Coordinator;
use crate::error::CoordinatorError;
use crate::store::{self, NodeRecord, TokenRecord};
use fleet_proto::NodeId;
use fleet_proto::clock::now_ms;
use fleet_proto::facts::Facts;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;

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
pub fn node_id(public_key: &[u8]) -> NodeId {
    NodeId::new(format!(
        "n-{}",
        &hex::encode(Sha256::digest(public_key))[..16]
    ))
}

impl Coordinator {
    pub fn nodes(&self) -> Result<Vec<NodeView>, CoordinatorError> {
        let now = now_ms();
        let mut nodes: Vec<NodeView> = (self.store().nodes()?.into_iter())
            .map(|n| view(n, now))
            .collect();
        nodes.extend(
            (self.store().failed_bootstraps()?.into_iter())
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
        id: node.id.to_string(),
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
