//! The node protocol, both sides: the machine's agent and the coordinator endpoint a hub embeds.

pub mod runtime;
pub mod state;

// The protocol, identity, join and session (issue 5).
pub mod agent;
pub mod backoff;
pub mod coordinator;
pub mod dial;
pub mod duration;
pub mod facts;
pub mod fsutil;
pub mod identity;
pub mod join;
pub mod joinfile;
pub mod logging;
pub mod node;
pub mod pin;
pub mod protocol;
pub mod session;
