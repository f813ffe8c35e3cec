//! The run store's on-disk format, shared with the agent.
