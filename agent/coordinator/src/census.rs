//! The fleet in counts at one moment, as the store says it: what a scrape reports, taken by the
//! background loop so scrapes read nothing from the store.
use crate::store::{ActiveRun, NodeRecord, Store, StoreResult};
use fleet_proto::NodeId;
use fleet_proto::run::RunState;
use std::collections::{BTreeMap, HashMap};

/// At most this many agent versions get a series of their own; the rest count as `other`, so a
/// machine reporting nonsense cannot grow the series without bound.
const MAX_VERSIONS: usize = 32;

/// What the store said of the fleet at one moment: the census the background loop takes every
/// heartbeat period while scrapes come (from the reads the sweep makes anyway, on the sweeping
/// coordinator), so a scrape reads nothing from the store. A scrape with no fresh census (the
/// first one, or one after a pause) reads the store itself.
#[derive(Debug, Default, Clone)]
pub(crate) struct FleetCounts {
    pub(crate) joined: u64,
    pub(crate) lost: u64,
    pub(crate) failed: u64,
    pub(crate) versions: BTreeMap<String, u64>,
    pub(crate) oldest_heartbeat_age_ms: u64,
    pub(crate) runs: BTreeMap<&'static str, u64>,
    pub(crate) waiting_offline: u64,
    pub(crate) waiting_online: u64,
}

impl FleetCounts {
    /// Counts `nodes` (with `failed` machines that never joined) and the runs out, at `now`.
    pub(crate) fn of(
        nodes: &[NodeRecord],
        failed: usize,
        active: &[ActiveRun],
        now: u64,
    ) -> FleetCounts {
        let mut counts = FleetCounts {
            failed: failed as u64,
            ..FleetCounts::default()
        };
        let mut joined: HashMap<&NodeId, bool> = HashMap::new();
        for node in nodes {
            let is_joined = now < node.lease_until_ms;
            if is_joined {
                counts.joined += 1;
                let heard = node.last_heartbeat_ms.unwrap_or(node.joined_at_ms);
                let age = now.saturating_sub(heard);
                counts.oldest_heartbeat_age_ms = counts.oldest_heartbeat_age_ms.max(age);
                let version = (node.facts.as_ref()).map_or("unknown", |f| f.agent_version.as_str());
                let known = counts.versions.contains_key(version);
                let key = if known || counts.versions.len() < MAX_VERSIONS {
                    version
                } else {
                    "other"
                };
                *counts.versions.entry(key.to_string()).or_default() += 1;
            } else {
                counts.lost += 1;
            }
            joined.insert(&node.id, is_joined);
        }
        for run in active {
            *counts.runs.entry(run.state.as_str()).or_default() += 1;
            if run.state == RunState::Waiting {
                match joined.get(&run.node_id) {
                    Some(true) => counts.waiting_online += 1,
                    _ => counts.waiting_offline += 1,
                }
            }
        }
        counts
    }

    /// Read from the store now: for a scrape before the first census.
    pub(crate) fn read(store: &Store, now: u64) -> StoreResult<FleetCounts> {
        let failed = store.failed_bootstraps()?.len();
        Ok(FleetCounts::of(
            &store.nodes()?,
            failed,
            &store.active_runs()?,
            now,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn node(id: &str, version: &str, lease_until_ms: u64) -> NodeRecord {
        serde_json::from_value(json!({
            "id": id, "public_key": "ed25519:x", "name": null, "joined_at_ms": 1_000,
            "last_heartbeat_ms": 9_000, "lease_until_ms": lease_until_ms, "generation": 1,
            "facts": { "arch": "x86_64", "cpus": 2, "memory_bytes": 1, "disk_free_bytes": 1,
                       "kernel": "k", "os": "o", "agent_version": version, "accelerators": [] }
        }))
        .unwrap()
    }

    fn waiting_run(id: &str, node: &str) -> ActiveRun {
        serde_json::from_value(json!({
            "id": id, "set_id": "s-1", "node_id": node, "state": "waiting",
            "workload": { "program": format!("sha256:{}", "0".repeat(64)) },
            "created_ms": 1, "updated_ms": 1, "accepted": false, "report": null,
            "error": null, "events": []
        }))
        .unwrap()
    }

    #[test]
    fn the_census_counts_states_versions_and_why_runs_wait() {
        let now = 10_000;
        let mut nodes = vec![node("n-lost", "0.1.0", now - 1)];
        // 40 versions reported: 32 get a series of their own, the rest count as `other`.
        nodes.extend((0..40).map(|i| node(&format!("n-{i}"), &format!("0.{i}.0"), now + 1)));
        let runs = [waiting_run("r-1", "n-0"), waiting_run("r-2", "n-lost")];
        let counts = FleetCounts::of(&nodes, 3, &runs, now);
        assert_eq!((counts.joined, counts.lost, counts.failed), (40, 1, 3));
        assert_eq!(counts.versions.len(), MAX_VERSIONS + 1);
        assert_eq!(counts.versions["other"], 40 - MAX_VERSIONS as u64);
        assert_eq!(counts.oldest_heartbeat_age_ms, 1_000);
        assert_eq!((counts.waiting_online, counts.waiting_offline), (1, 1));
        assert_eq!(counts.runs["waiting"], 2);
    }
}
