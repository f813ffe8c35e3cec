//! Tests: supervisor.
