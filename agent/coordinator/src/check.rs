//! `check --node N|--all`: each node runs its acceptance checks on itself (registry, store, disk,
//! engine) through its session, wherever that is held; the coordinator adds the rows only it can
//! judge: whether the node answered at all, and how far its clock is from this one's. A pool
//! asks the same before a new machine takes work.
use crate::{Coordinator, CoordinatorError};
use fleet_proto::NodeId;
use fleet_proto::check::{CheckName, CheckRequest, CheckRow, Verdict};
use fleet_proto::clock::now_ms;
use fleet_proto::protocol::{Command, Reply};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// The farthest a node's clock may be from the coordinator's, beyond the call's own time.
pub const MAX_CLOCK_SKEW_MS: u64 = 2_000;
/// Nodes checked at once.
const AT_ONCE: usize = 64;

/// Which nodes to check, and what to ask of each.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CheckNodes {
    /// A node's id or name; None: every node not retired or revoked.
    pub node: Option<String>,
    pub ask: CheckRequest,
}

/// One node's rows.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeChecks {
    pub node_id: NodeId,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub rows: Vec<CheckRow>,
}

impl NodeChecks {
    pub fn passed(&self) -> bool {
        self.rows.iter().all(|r| r.verdict != Verdict::Fail)
    }
}

impl Coordinator {
    /// Checks the nodes `request` names, at most [`AT_ONCE`] at a time, in the nodes' order.
    pub async fn check_nodes(
        self: &Arc<Self>,
        request: &CheckNodes,
    ) -> Result<Vec<NodeChecks>, CoordinatorError> {
        let wanted = request.node.clone();
        let nodes = self
            .with_store(move |store| {
                Ok(match &wanted {
                    Some(wanted) => crate::nodes::find_node_in(store, wanted).map(|n| vec![n]),
                    None => (store.nodes().map_err(CoordinatorError::from))
                        .map(|all| all.into_iter().filter(|n| n.ended.is_none()).collect()),
                })
            })
            .await??;
        if nodes.is_empty() {
            return Err(CoordinatorError::Request(
                "no node has joined yet: mint a join file with `fleet-coordinator token`".into(),
            ));
        }
        let turns = Arc::new(tokio::sync::Semaphore::new(AT_ONCE));
        let mut checks = tokio::task::JoinSet::new();
        for (at, node) in nodes.into_iter().enumerate() {
            let (coordinator, ask, turns) = (self.clone(), request.ask.clone(), turns.clone());
            checks.spawn(async move {
                let _turn = turns.acquire_owned().await;
                let rows = coordinator.check_one(&node.id, ask).await;
                (
                    at,
                    NodeChecks {
                        node_id: node.id,
                        name: node.name,
                        rows,
                    },
                )
            });
        }
        let mut done = Vec::new();
        while let Some(checked) = checks.join_next().await {
            // Cannot fail: a check returns its failures as rows; it panics only on a bug.
            done.push(checked.expect("a node's check does not panic"));
        }
        done.sort_by_key(|(at, _)| *at);
        Ok(done.into_iter().map(|(_, c)| c).collect())
    }

    async fn check_one(&self, node_id: &NodeId, ask: CheckRequest) -> Vec<CheckRow> {
        let sent = now_ms();
        let answer = self.call_node(node_id, "check", Command::Check(ask)).await;
        let received = now_ms();
        match answer {
            Ok(Reply::Checked { mut rows, clock_ms }) => {
                let session = format!("answered in {} ms", received.saturating_sub(sent));
                rows.insert(0, CheckRow::new(CheckName::Session, Verdict::Pass, session));
                rows.push(clock_row(sent, received, clock_ms));
                rows.sort_by_key(|r| r.check);
                rows
            }
            Ok(other) => vec![CheckRow::new(
                CheckName::Session,
                Verdict::Fail,
                format!("the node answered the check with {other:?}"),
            )],
            Err(CoordinatorError::Refused(refusal))
                if refusal.class == fleet_proto::protocol::RefusalClass::Malformed =>
            {
                vec![CheckRow::new(
                    CheckName::Session,
                    Verdict::Fail,
                    "its agent predates acceptance checks: update it (`fleet-coordinator update`)",
                )]
            }
            Err(e) => vec![CheckRow::new(
                CheckName::Session,
                Verdict::Fail,
                e.to_string(),
            )],
        }
    }
}

/// The node's clock against the coordinator's: it answered between `sent` and `received`, so
/// its clock is off by at least its distance from that window.
fn clock_row(sent: u64, received: u64, node: u64) -> CheckRow {
    let off = if node < sent {
        -((sent - node) as i64)
    } else {
        node.saturating_sub(received) as i64
    };
    let detail = format!(
        "{off:+} ms from this coordinator's (the call took {} ms)",
        received.saturating_sub(sent)
    );
    match off.unsigned_abs() <= MAX_CLOCK_SKEW_MS {
        true => CheckRow::new(CheckName::Clock, Verdict::Pass, detail),
        false => CheckRow::new(
            CheckName::Clock,
            Verdict::Fail,
            format!(
                "{detail}, past the {} ms allowed: run an NTP client (systemd-timesyncd, chrony) on the machine",
                MAX_CLOCK_SKEW_MS
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_clock_within_the_call_is_not_off() {
        assert_eq!(
            clock_row(1_000, 1_050, 1_020).detail,
            "+0 ms from this coordinator's (the call took 50 ms)"
        );
        assert_eq!(clock_row(1_000, 1_050, 1_020).verdict, Verdict::Pass);
        let ahead = clock_row(1_000, 1_050, 4_050);
        assert_eq!(ahead.verdict, Verdict::Fail);
        assert!(ahead.detail.starts_with("+3000 ms"), "{}", ahead.detail);
        let behind = clock_row(10_000, 10_010, 9_000);
        assert_eq!(
            (behind.verdict, behind.detail.starts_with("-1000 ms")),
            (Verdict::Pass, true)
        );
    }
}
