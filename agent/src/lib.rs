//! The node protocol, both sides: the machine's agent and the coordinator endpoint a hub embeds.
