//! One scrape: the fleet as the store says now (nodes by state, agents by version, runs out by
//! state, runs waiting and why), what this coordinator holds (sessions, content moved, the
//! fleet's coordinators), and the counted events, encoded in the format the scraper asked for.
use crate::Coordinator;
use crate::store::{Store, StoreResult};
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

/// What the store says of the fleet at one moment.
#[derive(Debug, Default)]
struct FleetCounts {
    joined: u64,
    lost: u64,
    failed: u64,
    versions: BTreeMap<String, u64>,
    oldest_heartbeat_age_ms: u64,
    runs: BTreeMap<&'static str, u64>,
    waiting_offline: u64,
    waiting_online: u64,
}

fn read_fleet(store: &Store, now: u64) -> StoreResult<FleetCounts> {
    let mut counts = FleetCounts::default();
    let mut joined: HashMap<NodeId, bool> = HashMap::new();
    for node in store.nodes()? {
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
        joined.insert(node.id, is_joined);
    }
    counts.failed = store.failed_bootstraps()?.len() as u64;
    for run in store.active_runs()? {
        *counts
            .runs
            .entry(super::recorder::state_label(run.state))
            .or_default() += 1;
        if run.state == RunState::Waiting {
            match joined.get(&run.node_id) {
                Some(true) => counts.waiting_online += 1,
                _ => counts.waiting_offline += 1,
            }
        }
    }
    Ok(counts)
}

/// One scrape's exposition, in `format`.
pub(crate) async fn exposition(coordinator: &Coordinator, format: Format) -> StoreResult<String> {
    let now = now_ms();
    let fleet = coordinator
        .with_store(move |store| read_fleet(store, now))
        .await?;
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

fn register_fleet(registry: &mut Registry, fleet: FleetCounts) {
    let nodes = Labeled::<&'static str>::default();
    for (state, n) in [
        ("joined", fleet.joined),
        ("lost", fleet.lost),
        ("failed", fleet.failed),
    ] {
        nodes.get_or_create(&[("state", state)]).set(n as i64);
    }
    registry.register(
        "fleet_nodes",
        "Nodes by state as the store says (the same at every coordinator of a fleet: aggregate with max, not sum)",
        nodes,
    );
    let agents = Labeled::<String>::default();
    for (version, n) in fleet.versions {
        agents.get_or_create(&[("version", version)]).set(n as i64);
    }
    registry.register(
        "fleet_agents",
        "Joined nodes by the agent version they reported",
        agents,
    );
    registry.register(
        "fleet_heartbeat_oldest_age_seconds",
        "Age of the oldest last heartbeat among joined nodes, as written to the store (up to 1 s behind)",
        ConstGauge::new(fleet.oldest_heartbeat_age_ms as f64 / 1000.0),
    );
    let runs = Labeled::<&'static str>::default();
    for state in [RunState::Waiting, RunState::Starting, RunState::Running] {
        let label = super::recorder::state_label(state);
        let n = fleet.runs.get(label).copied().unwrap_or(0);
        runs.get_or_create(&[("state", label)]).set(n as i64);
    }
    registry.register(
        "fleet_runs_out",
        "Runs not final yet, by state, across the fleet",
        runs,
    );
    let waiting = Labeled::<&'static str>::default();
    for (reason, n) in [
        ("node_in_session", fleet.waiting_online),
        ("node_not_in_session", fleet.waiting_offline),
    ] {
        waiting.get_or_create(&[("reason", reason)]).set(n as i64);
    }
    registry.register(
        "fleet_runs_waiting",
        "Runs no node has taken yet, by why: their node holds a session (being sent) or does not (lost, or not connected)",
        waiting,
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
    let build = Labeled::<&'static str>::default();
    build
        .get_or_create(&[("version", env!("CARGO_PKG_VERSION"))])
        .set(1);
    registry.register(
        "fleet_coordinator_build_info",
        "The coordinator's version, as a label on a constant 1",
        build,
    );
}
