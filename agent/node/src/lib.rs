//! The machine's agent: joins a coordinator, keeps its identity and durable state, reports the
//! machine's facts and runs work through a runtime. The wire is `fleet_proto`'s.
//!
//! API (what the tests and benchmarks drive): `agent::run` and its config, `node::Node`,
//! `runtime` (the `Runtime` trait and the process runtime), `state` (the node's store).
pub mod agent;
pub mod backoff;
pub mod check;
pub mod content;
pub mod dial;
pub mod ended;
pub mod facts;
pub mod fetched;
pub mod gpus;
pub mod identity;
pub mod join;
pub mod node;
pub mod runtime;
pub mod session;
pub mod state;
pub mod update;
pub mod url_read;
