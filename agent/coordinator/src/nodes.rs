//! The fleet's machines as `fleet-coordinator nodes` shows them: joined or lost by their lease,
//! and machines that reported a failed bootstrap on their token.
use crate::Coordinator;
use crate::error::CoordinatorError;
use crate::placement::Selector;
use crate::store::{
    self, EndOutcome, Ending, ForgetOutcome, NodeProtocol, NodeRecord, Store, StoreResult,
    TokenRecord,
};
use fleet_proto::NodeId;
use fleet_proto::clock::now_ms;
use fleet_proto::facts::Facts;
use fleet_proto::protocol::NodeEnd;
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

/// Whether a drained node still holds runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Drain {
    /// It takes no new run and still holds some.
    Draining,
    /// It takes no new run and holds none.
    Drained,
}

/// One row of `fleet-coordinator nodes`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeView {
    pub id: String,
    /// Its end, else its drain, else its lease: what `nodes` shows and `--state` selects.
    pub status: NodeStatus,
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
    /// The runs it holds that are not final (waiting for it, or running there).
    #[serde(default)]
    pub runs_out: u64,
    /// Set once it is drained (`fleet-coordinator drain`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain: Option<Drain>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drained_since_ms: Option<u64>,
    /// How many runs it takes at once: the lower of its agent's `--max-runs` and the operator's
    /// `fleet-coordinator capacity`; absent when neither limits it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<u32>,
    /// The operator's own limit, when set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity_set: Option<u32>,
    /// Set once the operator retired or revoked it: its key is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended: Option<Ending>,
    /// Since when it holds no run (its last run ended, or it joined); absent while it holds one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_since_ms: Option<u64>,
    /// The protocol version its newest session speaks, or why its last hello was refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol: Option<NodeProtocol>,
}

/// A node's state as `nodes` shows it and `nodes --state` selects: its end, else its drain, else
/// its lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum NodeStatus {
    Joined,
    Lost,
    Failed,
    Draining,
    Drained,
    Retired,
    Revoked,
}

impl NodeStatus {
    const ALL: [NodeStatus; 7] = [
        NodeStatus::Joined,
        NodeStatus::Lost,
        NodeStatus::Failed,
        NodeStatus::Draining,
        NodeStatus::Drained,
        NodeStatus::Retired,
        NodeStatus::Revoked,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            NodeStatus::Joined => "Joined",
            NodeStatus::Lost => "lost",
            NodeStatus::Failed => "failed",
            NodeStatus::Draining => "Draining",
            NodeStatus::Drained => "Drained",
            NodeStatus::Retired => "Retired",
            NodeStatus::Revoked => "Revoked",
        }
    }
}

impl std::str::FromStr for NodeStatus {
    type Err = String;

    /// Any case: `drained`, `Drained`.
    fn from_str(text: &str) -> Result<NodeStatus, String> {
        (NodeStatus::ALL.into_iter())
            .find(|s| s.as_str().eq_ignore_ascii_case(text))
            .ok_or_else(|| {
                let known: Vec<String> = (NodeStatus::ALL.iter())
                    .map(|s| s.as_str().to_lowercase())
                    .collect();
                format!("{text:?} is not a node state: one of {}", known.join(", "))
            })
    }
}

impl std::fmt::Display for NodeStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Which rows `nodes` shows: all by default.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct NodeFilter {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<NodeStatus>,
    /// Facts and labels, as `run --where` reads them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub place: Option<Selector>,
}

impl NodeFilter {
    fn keeps(&self, node: &NodeView) -> bool {
        self.status.is_none_or(|s| node.status == s)
            && self.place.as_ref().is_none_or(|p| p.matches(node))
    }
}

crate::placement::described_by_fields!(NodeView);

/// A node's id follows from its key, so the same key always gets the same id.
pub fn node_id(public_key: &[u8]) -> NodeId {
    NodeId::new(format!(
        "n-{}",
        &hex::encode(Sha256::digest(public_key))[..16]
    ))
}

impl Coordinator {
    /// The rows `filter` keeps, oldest first.
    pub fn nodes_matching(&self, filter: &NodeFilter) -> Result<Vec<NodeView>, CoordinatorError> {
        let mut nodes = self.nodes()?;
        nodes.retain(|n| filter.keeps(n));
        Ok(nodes)
    }

    pub fn nodes(&self) -> Result<Vec<NodeView>, CoordinatorError> {
        let now = now_ms();
        let out = self.store().runs_out()?;
        let mut nodes: Vec<NodeView> = (self.store().nodes()?.into_iter())
            .map(|n| {
                let held = out.get(&n.id).copied().unwrap_or(0);
                view(n, now, held)
            })
            .collect();
        nodes.extend(
            (self.store().failed_bootstraps()?.into_iter())
                .map(|(hash, token)| failed_view(&hash, token)),
        );
        nodes.sort_by(|a, b| a.joined_at_ms.cmp(&b.joined_at_ms).then(a.id.cmp(&b.id)));
        Ok(nodes)
    }

    /// The one node `wanted` names, by id or by name.
    pub fn find_node(&self, wanted: &str) -> Result<NodeRecord, CoordinatorError> {
        find_node_in(self.store(), wanted)
    }

    /// Sets and removes labels of the node `wanted` names, which `run --where label.K=V` reads.
    pub fn label(
        &self,
        wanted: &str,
        set: &[(String, String)],
        remove: &[String],
    ) -> Result<NodeView, CoordinatorError> {
        if set.is_empty() && remove.is_empty() {
            return Err(CoordinatorError::Request(
                "give labels as KEY=VALUE, or --remove KEY".into(),
            ));
        }
        for key in set.iter().map(|(k, _)| k).chain(remove) {
            if key.is_empty() || key.contains(|c: char| c == ',' || c == '=' || c.is_whitespace()) {
                return Err(CoordinatorError::Request(format!(
                    "the label key {key:?} is not a word: use letters, digits, '.', '-', '_' or '/'"
                )));
            }
        }
        self.change_node(wanted, |store, id| store.set_labels(id, set, remove))
    }

    /// Drains the node `wanted` names (it takes no new run and finishes what it holds), or with
    /// `undrain` takes it back; held in the store, so every coordinator of the fleet and every
    /// restart sees it.
    pub fn drain(&self, wanted: &str, undrain: bool) -> Result<NodeView, CoordinatorError> {
        let since = (!undrain).then(now_ms);
        self.change_node(wanted, |store, id| store.set_drain(id, since))
    }

    /// Sets how many runs the node `wanted` names takes at once (None: as many as its agent
    /// allows); runs past it stay waiting, queued in order, until one of its runs ends.
    pub fn set_capacity(
        &self,
        wanted: &str,
        runs: Option<u32>,
    ) -> Result<NodeView, CoordinatorError> {
        if runs == Some(0) {
            return Err(CoordinatorError::Request(
                "a capacity of 0 runs would take nothing: drain the node instead (`fleet-coordinator drain`)".into(),
            ));
        }
        self.change_node(wanted, |store, id| store.set_capacity(id, runs))
    }

    /// Retires (`NodeEnd::Retired`, refused while it holds runs unless `discard`) or revokes the
    /// node `wanted` names: its key is refused from now on by every coordinator of the fleet,
    /// the runs it holds end `lost`, and a session held here is told and cut at once (the other
    /// coordinators cut theirs when they see the store's count of ended nodes change).
    pub fn end_node(
        &self,
        wanted: &str,
        end: NodeEnd,
        discard: bool,
    ) -> Result<(NodeView, u64), CoordinatorError> {
        let found = self.find_node(wanted)?;
        let outcome = self.store().end_node(&found.id, end, discard, now_ms())?;
        let (node, lost) = match outcome {
            EndOutcome::Ended { node, lost } => (node, lost),
            EndOutcome::Unknown => return Err(forgotten_meanwhile(wanted)),
            EndOutcome::HoldsRuns(n) => {
                return Err(CoordinatorError::Request(format!(
                    "the node {wanted} holds {n} run(s) not final: drain it and wait for `Drained`, or pass --discard to end them lost"
                )));
            }
            EndOutcome::AlreadyEnded(before) => {
                return Err(CoordinatorError::Request(format!(
                    "the node {wanted} is already {}: its key is refused; `fleet-coordinator forget --node {wanted}` removes it",
                    before.as_str()
                )));
            }
        };
        self.sessions().end(&node.id, end);
        // A lost run with retries left waits for another node now.
        self.wake_waiting_sessions();
        tracing::info!(node_id = %node.id, end = end.as_str(), lost, "node ended by the operator");
        Ok((view(*node, now_ms(), 0), lost))
    }

    /// Removes the record of the node `wanted` names; refused for one that holds its lease and
    /// was not retired or revoked.
    pub fn forget(&self, wanted: &str) -> Result<NodeView, CoordinatorError> {
        let found = self.find_node(wanted)?;
        match self.store().forget_node(&found.id, now_ms())? {
            ForgetOutcome::Forgotten(node) => {
                self.wake_waiting_sessions();
                Ok(view(*node, now_ms(), 0))
            }
            ForgetOutcome::Unknown => Err(forgotten_meanwhile(wanted)),
            ForgetOutcome::Live => Err(CoordinatorError::Request(format!(
                "the node {wanted} is live (it holds its lease): retire or revoke it first"
            ))),
        }
    }

    /// Applies an operator's change to the node `wanted` names and shows it as it now stands.
    fn change_node(
        &self,
        wanted: &str,
        change: impl FnOnce(&Store, &NodeId) -> StoreResult<Option<NodeRecord>>,
    ) -> Result<NodeView, CoordinatorError> {
        let node = self.find_node(wanted)?;
        if let Some(ending) = node.ended {
            return Err(CoordinatorError::Request(format!(
                "the node {wanted} is {}: nothing about it changes any more; `fleet-coordinator forget --node {wanted}` removes it",
                ending.end.as_str()
            )));
        }
        let node = change(self.store(), &node.id)?.ok_or_else(|| forgotten_meanwhile(wanted))?;
        let held = self.store().runs_out()?.get(&node.id).copied().unwrap_or(0);
        Ok(view(node, now_ms(), held))
    }
}

fn forgotten_meanwhile(wanted: &str) -> CoordinatorError {
    CoordinatorError::Request(format!("the node {wanted} was forgotten meanwhile"))
}

fn view(node: NodeRecord, now: u64, runs_out: u64) -> NodeView {
    let capacity = node.capacity();
    let state = if now < node.lease_until_ms {
        NodeState::Joined
    } else {
        NodeState::Lost
    };
    let drain = node.drained_since_ms.map(|_| match runs_out {
        0 => Drain::Drained,
        _ => Drain::Draining,
    });
    let status = match (node.ended.map(|e| e.end), drain, state) {
        (Some(NodeEnd::Retired), _, _) => NodeStatus::Retired,
        (Some(NodeEnd::Revoked), _, _) => NodeStatus::Revoked,
        (None, Some(Drain::Draining), NodeState::Joined) => NodeStatus::Draining,
        (None, Some(Drain::Drained), NodeState::Joined) => NodeStatus::Drained,
        (None, _, NodeState::Joined) => NodeStatus::Joined,
        (None, _, _) => NodeStatus::Lost,
    };
    NodeView {
        id: node.id.to_string(),
        status,
        state,
        name: node.name,
        public_key: node.public_key,
        labels: node.labels,
        joined_at_ms: node.joined_at_ms,
        last_heartbeat_ms: node.last_heartbeat_ms,
        sessions: node.generation,
        facts: node.facts,
        error: None,
        runs_out,
        drain,
        drained_since_ms: node.drained_since_ms,
        capacity,
        capacity_set: node.capacity,
        ended: node.ended,
        idle_since_ms: (runs_out == 0).then(|| node.idle_since_ms.unwrap_or(node.joined_at_ms)),
        protocol: node.protocol,
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
        status: NodeStatus::Failed,
        state: NodeState::Failed,
        name: token.name,
        public_key: "-".into(),
        labels: token.labels,
        joined_at_ms: failure.at_ms,
        last_heartbeat_ms: None,
        sessions: 0,
        facts: None,
        error: Some(format!("bootstrap failed: {}", failure.reason)),
        runs_out: 0,
        drain: None,
        drained_since_ms: None,
        ended: None,
        capacity: None,
        capacity_set: None,
        idle_since_ms: None,
        protocol: None,
    }
}

/// The one node of `store` whose id or name is `wanted`; blocking, so from async code through
/// `with_store`.
pub(crate) fn find_node_in(store: &Store, wanted: &str) -> Result<NodeRecord, CoordinatorError> {
    let mut found: Vec<NodeRecord> = (store.nodes()?.into_iter())
        .filter(|n| n.id.as_str() == wanted || n.name.as_deref() == Some(wanted))
        .collect();
    match found.len() {
        0 => Err(CoordinatorError::Request(format!(
            "no node matches {wanted}: see `fleet-coordinator nodes`"
        ))),
        1 => Ok(found.remove(0)),
        n => {
            let ids: Vec<&str> = found.iter().map(|n| n.id.as_str()).collect();
            Err(CoordinatorError::Request(format!(
                "{n} nodes are named {wanted} ({}): name one by its id",
                ids.join(", ")
            )))
        }
    }
}
