//! One scrape: the fleet as the store says now (nodes by state, agents by version, runs out by
//! state, runs waiting and why), what this coordinator holds (sessions, content moved, the
//! fleet's coordinators), and the counted events, encoded in the format the scraper asked for.
use crate::Coordinator;
use crate::store::{ActiveRun, NodeRecord, Store, StoreResult};
use fleet_proto::NodeId;
use fleet_proto::clock::now_ms;
use fleet_proto::run::RunState;
use prometheus_client::encoding::{prometheus_text, text};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::registry::Registry;
use std::collections::{BTreeMap, HashMap};

/// At most this many agent versions get a series of their own; the rest count as `other`, so a
/// machine reporting nonsense cannot grow the series without bound.
const MAX_VERSIONS: usize = 32;

/// The exposition formats a scraper may ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Format {
    /// `text/plain; version=0.0.4`, what Prometheus reads by default.
    Prometheus,
    /// `application/openmetrics-text; version=1.0.0`, when the `Accept` header names it.
    OpenMetrics,
}

impl Format {
    pub(crate) fn for_accept(accept: Option<&str>) -> Format {
        match accept {
            Some(a) if a.contains("application/openmetrics-text") => Format::OpenMetrics,
            _ => Format::Prometheus,
        }
    }

    pub(crate) fn content_type(self) -> &'static str {
        match self {
            Format::Prometheus => prometheus_text::CONTENT_TYPE,
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
        }
    }
}

/// What the store said of the fleet at one moment: the census the background loop takes every
/// heartbeat period while scrapes come (from the reads the sweep makes anyway, on the sweeping
/// coordinator), so a scrape reads nothing from the store. A scrape with no fresh census (the
/// first one, or one after a pause) reads the store itself.
#[derive(Debug, Default, Clone)]
pub(crate) struct FleetCounts {
    joined: u64,
    lost: u64,
    failed: u64,
    versions: BTreeMap<String, u64>,
    oldest_heartbeat_age_ms: u64,
    runs: BTreeMap<&'static str, u64>,
    waiting_offline: u64,
    waiting_online: u64,
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
    fn read(store: &Store, now: u64) -> StoreResult<FleetCounts> {
        let failed = store.failed_bootstraps()?.len();
        Ok(FleetCounts::of(
            &store.nodes()?,
            failed,
            &store.active_runs()?,
            now,
        ))
    }
}

/// One scrape's exposition, in `format`.
pub(crate) async fn exposition(coordinator: &Coordinator, format: Format) -> StoreResult<String> {
    let now = now_ms();
    let fleet = match coordinator.recorder().census(now) {
        Some(census) => census,
        None => {
            (coordinator)
                .with_store(move |store| FleetCounts::read(store, now))
                .await?
        }
    };
    let mut registry = Registry::default();
    register_fleet(&mut registry, fleet);
    register_live(&mut registry, coordinator);
    coordinator.recorder().register(&mut registry);
    let mut out = String::new();
    let encoded = match format {
        Format::Prometheus => prometheus_text::encode(&mut out, &registry),
        Format::OpenMetrics => text::encode(&mut out, &registry),
    };
    encoded.map_err(|_| crate::store::StoreError::Db("encoding the metrics failed".into()))?;
    Ok(out)
}

type Labeled<V> = Family<[(&'static str, V); 1], Gauge>;

/// A gauge per value of one label, set to the counts given.
fn by_label<V>(key: &'static str, counts: impl IntoIterator<Item = (V, u64)>) -> Labeled<V>
where
    V: Clone
        + std::hash::Hash
        + Eq
        + prometheus_client::encoding::EncodeLabelValue
        + Send
        + Sync
        + std::fmt::Debug
        + 'static,
{
    let family = Labeled::<V>::default();
    for (value, n) in counts {
        family.get_or_create(&[(key, value)]).set(n as i64);
    }
    family
}

fn register_fleet(registry: &mut Registry, fleet: FleetCounts) {
    let nodes = [
        ("joined", fleet.joined),
        ("lost", fleet.lost),
        ("failed", fleet.failed),
    ];
    registry.register(
        "fleet_nodes",
        "Nodes by state as the store said at the last census, taken every heartbeat period (the same at every coordinator of a fleet: aggregate with max, not sum)",
        by_label("state", nodes),
    );
    registry.register(
        "fleet_agents",
        "Joined nodes by the agent version they reported",
        by_label("version", fleet.versions),
    );
    registry.register(
        "fleet_heartbeat_oldest_age_seconds",
        "Age of the oldest last heartbeat among joined nodes, as of the last census (taken every heartbeat period)",
        ConstGauge::new(fleet.oldest_heartbeat_age_ms as f64 / 1000.0),
    );
    let runs = [RunState::Waiting, RunState::Starting, RunState::Running].map(|state| {
        (
            state.as_str(),
            fleet.runs.get(state.as_str()).copied().unwrap_or(0),
        )
    });
    registry.register(
        "fleet_runs_out",
        "Runs not final yet, by state, across the fleet",
        by_label("state", runs),
    );
    let waiting = [
        ("node_in_session", fleet.waiting_online),
        ("node_not_in_session", fleet.waiting_offline),
    ];
    registry.register(
        "fleet_runs_waiting",
        "Runs no node has taken yet, by why: their node holds a session (being sent) or does not (lost, or not connected)",
        by_label("reason", waiting),
    );
}

fn register_live(registry: &mut Registry, coordinator: &Coordinator) {
    registry.register(
        "fleet_sessions",
        "Node sessions this coordinator holds",
        ConstGauge::new(coordinator.sessions().count() as i64),
    );
    registry.register(
        "fleet_coordinators",
        "Coordinators of the fleet this one heard from lately, itself included",
        ConstGauge::new(coordinator.fleet().members().len().max(1) as i64),
    );
    let (sent, received) = coordinator.traffic().totals();
    registry.register(
        "fleet_content_sent_bytes",
        "Content bytes this coordinator sent to nodes and coordinators",
        ConstCounter::new(sent),
    );
    registry.register(
        "fleet_content_received_bytes",
        "Content bytes this coordinator received from nodes",
        ConstCounter::new(received),
    );
    registry.register(
        "fleet_coordinator_build_info",
        "The coordinator's version, as a label on a constant 1",
        by_label("version", [(env!("CARGO_PKG_VERSION"), 1)]),
    );
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
