//! One scrape: the fleet as the store says now (nodes by state, agents by version, runs out by
//! state, runs waiting and why), what this coordinator holds (sessions, content moved, the
//! fleet's coordinators), and the counted events, encoded in the format the scraper asked for.
use crate::Coordinator;
use crate::census::FleetCounts;
use crate::store::StoreResult;
use fleet_proto::clock::now_ms;
use fleet_proto::run::RunState;
use prometheus_client::encoding::{prometheus_text, text};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::registry::Registry;

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
