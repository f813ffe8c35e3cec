//! The workspace's integration tests, one module per area, in one test binary.
mod agent_join;
mod agent_runs;
mod oci_build;
mod oci_remote;
mod supervisor;
