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
    /// The container engine images run on; absent from agents before engine facts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<EngineFacts>,
    /// The content already on the machine; absent from agents before inventories.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<ContentInventory>,
}

/// The container engine as the agent last reached it: which, which version, which API, or why
/// it could not be reached.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineFacts {
    /// `docker`: the only engine the agent drives.
    pub name: String,
    pub reachable: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// The API version the agent speaks with it (negotiated down to the engine's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_version: Option<String>,
    /// Why it could not be reached, in one line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The digests a machine holds: its content and programs, and its engine's images (by their
/// manifest digests), the most recently used first. At most [`ContentInventory::CAP`] are
/// listed; `total` counts them all.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ContentInventory {
    pub digests: Vec<crate::Digest>,
    /// How many digests the machine holds, listed or not.
    pub total: u64,
    /// Of those, how many are engine images.
    #[serde(default)]
    pub images: u64,
}

impl ContentInventory {
    /// The most digests one facts message lists (about 4.6 KiB of JSON): every coordinator reads
    /// every node's facts to place a run, so a fleet of 30 000 keeps this small.
    pub const CAP: usize = 64;

    /// The inventory of `held`, the most wanted first (each listed once), listing at most
    /// [`Self::CAP`].
    pub fn of(held: impl IntoIterator<Item = crate::Digest>, images: u64) -> ContentInventory {
        let mut seen = std::collections::HashSet::new();
        let mut digests = Vec::new();
        for digest in held {
            if seen.insert(digest) && digests.len() < Self::CAP {
                digests.push(digest);
            }
        }
        ContentInventory {
            total: seen.len() as u64,
            images,
            digests,
        }
    }

    /// Whether the listed digests hold `digest` (an inventory over its cap may hold more).
    pub fn holds(&self, digest: &crate::Digest) -> bool {
        self.digests.contains(digest)
    }

    /// Whether some digests were left out for the cap.
    pub fn truncated(&self) -> bool {
        self.total > self.digests.len() as u64
    }
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
    /// Who made it; agents before other vendors reported NVIDIA's alone.
    #[serde(default)]
    pub vendor: GpuVendor,
    /// The instruction set it runs, where one names it: AMD's `gfx` target (`gfx1201`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arch: Option<String>,
}

/// A GPU's maker, as `--where gpu.vendor=` names it.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum GpuVendor {
    #[default]
    Nvidia,
    Amd,
    Intel,
}

impl GpuVendor {
    pub const ALL: [GpuVendor; 3] = [GpuVendor::Nvidia, GpuVendor::Amd, GpuVendor::Intel];

    pub fn as_str(self) -> &'static str {
        match self {
            GpuVendor::Nvidia => "nvidia",
            GpuVendor::Amd => "amd",
            GpuVendor::Intel => "intel",
        }
    }

    /// The PCI vendor id the kernel reports for it.
    pub fn pci_id(self) -> u16 {
        match self {
            GpuVendor::Nvidia => 0x10de,
            GpuVendor::Amd => 0x1002,
            GpuVendor::Intel => 0x8086,
        }
    }
}

impl std::str::FromStr for GpuVendor {
    type Err = String;
    fn from_str(text: &str) -> Result<GpuVendor, String> {
        GpuVendor::ALL
            .into_iter()
            .find(|v| v.as_str() == text)
            .ok_or_else(|| {
                format!("{text:?} is not a GPU vendor: the vendors are nvidia, amd, intel")
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_inventory_lists_each_digest_once_the_first_up_to_its_cap() {
        let digests: Vec<crate::Digest> = (0..100u32)
            .map(|i| crate::Digest::of(&i.to_be_bytes()))
            .collect();
        let first = digests[0];
        let inventory = ContentInventory::of(
            [first]
                .into_iter()
                .chain(digests.iter().copied())
                .chain([first]),
            3,
        );
        assert_eq!((inventory.total, inventory.images), (100, 3));
        assert_eq!(inventory.digests.len(), ContentInventory::CAP);
        assert_eq!(inventory.digests[..2], digests[..2]);
        assert!(inventory.holds(&first) && !inventory.holds(&digests[99]));
        assert!(inventory.truncated());
        assert!(!ContentInventory::of(digests[..3].iter().copied(), 0).truncated());
    }
}
