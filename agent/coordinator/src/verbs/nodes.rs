//! The node commands: `nodes`, `check`, `drain`, `capacity`, `label`, `retire`, `revoke`,
//! `forget`, and how each prints.
use super::{Place, operate};
use crate::cli::{CapacityArgs, CheckArgs, DrainArgs, LabelArgs, NodeArgs, NodesArgs, RetireArgs};
use anyhow::Result;
use fleet_coordinator::check::CheckNodes;
use fleet_coordinator::commands::{Capacity, Drain, EndNode, Forget, Label, ListNodes};
use fleet_coordinator::store::NodeProtocol;
use fleet_coordinator::{NodeFilter, NodeView};
use fleet_proto::protocol::NodeEnd;

/// `nodes [--state S] [--where EXPR] [--json]`.
pub fn nodes(place: &Place, n: NodesArgs) -> Result<()> {
    let filter = NodeFilter {
        status: (n.state.as_deref().map(str::parse))
            .transpose()
            .map_err(anyhow::Error::msg)?,
        place: super::runs::selector(n.where_.as_deref())?,
    };
    let nodes = operate(place, ListNodes { filter })?;
    print_nodes(&n, nodes)
}

/// `check --node N|--all`: one row per node and check.
pub fn check(place: &Place, c: CheckArgs) -> Result<()> {
    let request = CheckNodes {
        node: c.node.clone(),
        ask: fleet_proto::check::CheckRequest {
            registry: c.registry.clone(),
            min_disk_bytes: c.min_disk,
        },
    };
    print_checks(&operate(place, request)?, c.json)
}

pub fn label(place: &Place, l: LabelArgs) -> Result<()> {
    let node = operate(
        place,
        Label {
            node: l.node,
            set: l.labels,
            remove: l.remove,
        },
    )?;
    let labels: Vec<String> = (node.labels.iter())
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    println!("{} {}", node.id, labels.join(","));
    Ok(())
}

pub fn capacity(place: &Place, c: CapacityArgs) -> Result<()> {
    let node = operate(
        place,
        Capacity {
            node: c.node,
            runs: c.runs,
        },
    )?;
    match node.capacity {
        Some(k) => println!(
            "{} takes {k} run(s) at once ({} out)",
            node.id, node.runs_out
        ),
        None => println!(
            "{} takes runs without a limit ({} out)",
            node.id, node.runs_out
        ),
    }
    Ok(())
}

pub fn drain(place: &Place, d: DrainArgs) -> Result<()> {
    let node = operate(
        place,
        Drain {
            node: d.node,
            undrain: d.undrain,
        },
    )?;
    match node.drain {
        None => println!("{} takes new runs again", node.id),
        Some(_) => println!(
            "{} is {}: it takes no new run ({} out)",
            node.id, node.status, node.runs_out
        ),
    }
    Ok(())
}

pub fn retire(place: &Place, r: RetireArgs) -> Result<()> {
    end_node(place, r.node, NodeEnd::Retired, r.discard)
}

pub fn revoke(place: &Place, r: NodeArgs) -> Result<()> {
    end_node(place, r.node, NodeEnd::Revoked, false)
}

pub fn forget(place: &Place, f: NodeArgs) -> Result<()> {
    let node = operate(place, Forget { node: f.node })?;
    println!("{} is forgotten", node.id);
    Ok(())
}

/// Retires or revokes a node and says what became of it.
fn end_node(place: &Place, node: String, end: NodeEnd, discard: bool) -> Result<()> {
    let ended = operate(place, EndNode { node, end, discard })?;
    println!(
        "{} is {}: its key is refused from now on ({} run(s) ended lost)",
        ended.node.id,
        end.as_str(),
        ended.lost
    );
    Ok(())
}

/// One row per node and check; fails (exit 1) naming how many nodes failed a check.
fn print_checks(checked: &[fleet_coordinator::check::NodeChecks], json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(checked)?);
    } else {
        println!(
            "{:<20} {:<12} {:<9} {:<8} DETAIL",
            "NODE", "NAME", "CHECK", "RESULT"
        );
        for node in checked {
            for row in &node.rows {
                println!(
                    "{:<20} {:<12} {:<9} {:<8} {}",
                    node.node_id,
                    node.name.as_deref().unwrap_or("-"),
                    row.check.as_str(),
                    row.verdict.as_str(),
                    row.detail
                );
            }
        }
    }
    let failed = checked.iter().filter(|n| !n.passed()).count();
    if failed > 0 {
        anyhow::bail!(
            "{failed} of {} node(s) failed a check: see the rows marked fail",
            checked.len()
        );
    }
    Ok(())
}

fn print_nodes(args: &NodesArgs, nodes: Vec<NodeView>) -> Result<()> {
    if args.json {
        println!("{}", serde_json::to_string_pretty(&nodes)?);
        return Ok(());
    }
    println!(
        "{:<20} {:<8} {:<16} {:<8} {:>4} {:>4} {:>6} {:<8} {:<10} {:<8} {:<8} {:<9} {:<14} {:<16} PUBLIC KEY",
        "ID",
        "STATE",
        "NAME",
        "ARCH",
        "CPUS",
        "GPUS",
        "RUNS",
        "IDLE",
        "VERSION",
        "PROTOCOL",
        "RELEASE",
        "UPDATE",
        "HEARTBEAT",
        "LABELS"
    );
    let now = fleet_proto::clock::now_ms();
    let ago = |t: u64| format!("{} s", now.saturating_sub(t) / 1000);
    for n in nodes {
        let facts = n.facts.as_ref();
        let release = facts.and_then(|f| f.release.as_ref());
        let labels: Vec<String> = n.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        println!(
            "{:<20} {:<8} {:<16} {:<8} {:>4} {:>4} {:>6} {:<8} {:<10} {:<8} {:<8} {:<9} {:<14} {:<16} {}",
            n.id,
            n.status,
            n.name.as_deref().unwrap_or("-"),
            facts.map_or("-", |f| f.arch.as_str()),
            facts.map_or(0, |f| f.cpus),
            facts.map_or(0, |f| f.accelerators.len()),
            // Out of its capacity, when it has one: `3/4`.
            n.capacity
                .map_or(n.runs_out.to_string(), |c| format!("{}/{c}", n.runs_out)),
            n.idle_since_ms.map_or("-".into(), ago),
            facts.map_or("-", |f| f.agent_version.as_str()),
            match n.protocol {
                Some(NodeProtocol::Speaks { version }) => version.to_string(),
                Some(NodeProtocol::Refused(_)) => "refused".into(),
                None => "-".into(),
            },
            release.map_or("-".into(), |r| r.sequence.to_string()),
            release
                .and_then(|r| r.update.as_ref())
                .map_or("-", update_word),
            n.last_heartbeat_ms
                .map_or("never".into(), |t| format!("{} ago", ago(t))),
            if labels.is_empty() {
                "-".into()
            } else {
                labels.join(",")
            },
            // Why it is not served, where something says so; else its key.
            match (&n.error, n.protocol) {
                (Some(error), _) => error.clone(),
                (None, Some(refused @ NodeProtocol::Refused(_))) => refused.to_string(),
                (None, _) => n.public_key.clone(),
            }
        );
    }
    Ok(())
}

/// The state of a node's last update, in one word for the `nodes` table (`--json` has it whole).
fn update_word(outcome: &fleet_proto::release::UpdateOutcome) -> &'static str {
    use fleet_proto::release::UpdateOutcome;
    match outcome {
        UpdateOutcome::Trial { .. } => "trial",
        UpdateOutcome::Kept { .. } => "kept",
        UpdateOutcome::Reverted { .. } => "reverted",
        UpdateOutcome::Refused { .. } => "refused",
    }
}
