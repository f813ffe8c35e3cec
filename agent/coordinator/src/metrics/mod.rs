//! What an operator scrapes and looks at: the coordinator's metrics in the Prometheus text format
//! (OpenMetrics when asked), `/healthz` and `/readyz`, and the status page (`page`), on a listener
//! of their own (`serve --metrics-listen`).
//!
//! Two kinds of figures. Events counted as they happen (a `Recorder`, one per coordinator:
//! commits, heartbeats heard, runs that started or ended through this coordinator, the connection
//! cap; [`crate::recorder`]) and the fleet's state read at scrape time from the store and the live owners
//! ([`scrape`]). No label names a node, a run or a set: the series stay few whatever the fleet.
mod auth;
mod listener;
mod page;
mod scrape;

pub use auth::{AuthError, BearerToken};
pub use listener::{MetricsListenError, MetricsListener, serve_metrics};
