//! The coordinator: the hub's endpoint for the node protocol. A hub embeds [`Coordinator`] and
//! [`serve::serve`]; the `fleet-coordinator` binary drives the same code.
//!
//! API: `Coordinator` (open, tokens, nodes, and the run API in `runs`), `serve` (the port),
//! `operator` (requests a CLI or hub sends to a serving coordinator), `store` (the store
//! and its rules, over a backend: the embedded redb one or PostgreSQL, by [`StoreLocation`]),
//! `userdata` (the `#cloud-config`), `signing` (the images the fleet trusts), `metrics` (the diagnostic listener: metrics and health). Every other module is the crate's own.
mod bundles;
mod census;
pub mod check;
pub mod commands;
mod commit;
mod content;
mod coordinator;
mod error;
mod folder;
mod http;
mod ids;
mod live;
pub mod metrics;
mod nodes;
pub mod operator;
mod peer;
pub mod placement;
pub mod progress;
pub mod push;
mod recorder;
pub mod release;
pub mod rollout;
pub mod runs;
pub mod serve;
pub mod signing;
pub mod store;
mod tokens;
pub mod userdata;

pub use bundles::{bundle_path, file_sha256};
pub use content::BLOB_GRACE;
pub use coordinator::{Coordinator, StoreLocation, blobs};
pub use error::CoordinatorError;
pub use error::PeerError;
pub use folder::{DEFAULT_DATA, DEFAULT_PORT, KEY_FILE, POSTGRES_MARK, STORE_FILE};
pub use live::{DEFAULT_FETCH_WINDOW, TicketRefusal};
pub use nodes::{NodeFilter, NodeState, NodeStatus, NodeView, node_id};
pub use tokens::{TokenRequest, token_hash};
