//! Tests: agent_runs.
