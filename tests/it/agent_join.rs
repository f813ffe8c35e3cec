//! Tests: agent_join.
