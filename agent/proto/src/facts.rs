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
    /// How many runs the agent takes at once (`fleet-agent --max-runs`); absent when it sets
    /// no limit of its own (and from agents before it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_runs: Option<u32>,
    /// The slowest whole artifact copy this machine made in the last hour, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measured_link: Option<MeasuredLink>,
    /// The release it runs and how its last update went; absent from agents before releases.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub release: Option<crate::release::ReleaseFacts>,
}

/// How fast this machine really copied an artifact: the path, its disk and the hash together,
/// timed as one whole copy (not the network alone). The slowest copy seen, valid for one hour
/// from the last reading. Ages rather than dates, so no clock is compared across machines.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MeasuredLink {
    pub bytes_per_s: u64,
    /// How long ago the last copy was timed.
    pub age_ms: u64,
    /// How much longer this reading stands.
    pub valid_for_ms: u64,
    pub confidence: f64,
    /// What was timed: always `whole_copy`.
    pub basis: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Accelerator {
    pub index: u32,
    pub name: String,
    pub uuid: String,
    pub memory_mib: u64,
    pub driver: String,
}
