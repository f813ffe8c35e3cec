//! What a machine is, as the agent reports it: architecture, CPUs, memory, free disk under the
//! run store, kernel, OS, agent version and accelerators.
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Facts {
    pub arch: String,
    pub cpus: usize,
    pub memory_bytes: u64,
    pub disk_free_bytes: u64,
    pub kernel: String,
    pub os: String,
    pub agent_version: String,
    pub accelerators: Vec<Accelerator>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Accelerator {
    pub index: u32,
    pub name: String,
    pub uuid: String,
    pub memory_mib: u64,
    pub driver: String,
}
