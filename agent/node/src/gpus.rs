//! A machine's GPUs: NVIDIA's from `nvidia-smi`, AMD's and Intel's from the kernel's own files
//! (`class/drm/card*/device` under a settable sysfs root, and AMD's `gfx` target from the KFD
//! topology), with `rocm-smi`'s names where it is present. A file that does not parse leaves
//! that GPU out with one warning; nothing here fails the agent.
use fleet_proto::facts::{Accelerator, GpuVendor};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub const NVIDIA_SMI_ARGS: [&str; 2] = [
    "--query-gpu=index,name,uuid,memory.total,driver_version",
    "--format=csv,noheader,nounits",
];
pub const ROCM_SMI_ARGS: [&str; 4] = ["--showproductname", "--showuniqueid", "--showbus", "--json"];
/// How long a vendor tool may take before its answer is given up.
const TOOL_TIMEOUT: Duration = Duration::from_secs(10);

/// Where the GPU facts come from on this machine.
#[derive(Debug, Clone)]
pub struct GpuSources {
    /// `nvidia-smi` (`--accelerator-tool`).
    pub nvidia_tool: PathBuf,
    /// `rocm-smi` (`--rocm-tool`): names AMD's cards where it is installed.
    pub rocm_tool: PathBuf,
    /// The kernel's report root (`--sysfs-root`, `/sys` on a real machine).
    pub sysfs: PathBuf,
}

impl GpuSources {
    /// Every GPU the machine has: NVIDIA's first, then AMD's and Intel's in card order.
    pub async fn accelerators(&self) -> Vec<Accelerator> {
        let mut all = match run_tool(&self.nvidia_tool, &NVIDIA_SMI_ARGS).await {
            Some(csv) => parse_nvidia_smi(&csv),
            None => Vec::new(),
        };
        let mut kernel = from_sysfs(&self.sysfs);
        if kernel.iter().any(|(_, g)| g.vendor == GpuVendor::Amd)
            && let Some(json) = run_tool(&self.rocm_tool, &ROCM_SMI_ARGS).await
        {
            name_from_rocm_smi(&mut kernel, &json);
        }
        all.extend(kernel.into_iter().map(|(_, gpu)| gpu));
        all
    }
}

/// A vendor tool's standard output, or None (logged) when it is missing, fails or hangs.
async fn run_tool(tool: &Path, args: &[&str]) -> Option<String> {
    let run = tokio::process::Command::new(tool)
        .args(args)
        .kill_on_drop(true)
        .output();
    match tokio::time::timeout(TOOL_TIMEOUT, run).await {
        Ok(Ok(out)) if out.status.success() => Some(String::from_utf8_lossy(&out.stdout).into()),
        Ok(Ok(out)) => {
            warn_once(format!(
                "the accelerator tool {} failed ({}); its GPUs are left out of the facts",
                tool.display(),
                out.status
            ));
            None
        }
        Ok(Err(e)) => {
            tracing::debug!(tool = %tool.display(), error = %e, "no accelerator tool");
            None
        }
        Err(_) => {
            warn_once(format!(
                "the accelerator tool {} hung for {} s; its GPUs are left out of the facts",
                tool.display(),
                TOOL_TIMEOUT.as_secs()
            ));
            None
        }
    }
}

/// Logs `message` once in the agent's life: facts are gathered again and again.
fn warn_once(message: String) {
    static WARNED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let mut warned = WARNED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if !warned.contains(&message) {
        tracing::warn!("{message}");
        warned.push(message);
    }
}

/// Parses `index, name, uuid, memory.total, driver_version` lines; skips lines it cannot read.
pub fn parse_nvidia_smi(csv: &str) -> Vec<Accelerator> {
    csv.lines()
        .filter_map(|line| {
            let cols: Vec<&str> = line.split(',').map(str::trim).collect();
            let [index, name, uuid, memory, driver] = cols.as_slice() else {
                return None;
            };
            Some(Accelerator {
                index: index.parse().ok()?,
                name: name.to_string(),
                uuid: uuid.to_string(),
                memory_mib: memory.parse().ok()?,
                driver: driver.to_string(),
                vendor: GpuVendor::Nvidia,
                arch: None,
            })
        })
        .collect()
}

/// AMD's and Intel's GPUs as the kernel reports them under `sysfs`, keyed by PCI address.
pub fn from_sysfs(sysfs: &Path) -> Vec<(String, Accelerator)> {
    let Ok(entries) = std::fs::read_dir(sysfs.join("class/drm")) else {
        return Vec::new();
    };
    // card0, card1, ...: connectors (card0-DP-1) and render nodes are not cards.
    let mut cards: Vec<(u32, PathBuf)> = entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let n = name.strip_prefix("card")?.parse().ok()?;
            Some((n, e.path()))
        })
        .collect();
    cards.sort();
    let targets = kfd_targets(sysfs);
    let mut counts: BTreeMap<GpuVendor, u32> = BTreeMap::new();
    let mut found: Vec<(String, Accelerator)> = Vec::new();
    for (_, card) in cards {
        match read_card(&card, &targets) {
            Ok(Some((address, mut gpu))) if !found.iter().any(|(a, _)| *a == address) => {
                let index = counts.entry(gpu.vendor).or_default();
                gpu.index = *index;
                *index += 1;
                found.push((address, gpu));
            }
            Ok(_) => {}
            Err(why) => warn_once(format!(
                "{}: {why}; that GPU is left out of the facts",
                card.display()
            )),
        }
    }
    found
}

/// One card: None for a device that is no AMD or Intel GPU (NVIDIA's come from its tool).
fn read_card(
    card: &Path,
    targets: &BTreeMap<u32, String>,
) -> Result<Option<(String, Accelerator)>, String> {
    let device = card.join("device");
    let Some(vendor) = read_trimmed(&device.join("vendor")) else {
        return Ok(None);
    };
    let vendor = hex_id(&vendor).ok_or_else(|| format!("vendor {vendor:?} is not a PCI id"))?;
    let id_text = read_trimmed(&device.join("device")).unwrap_or_default();
    let id = hex_id(&id_text).ok_or_else(|| format!("device {id_text:?} is not a PCI id"))?;
    let address = (std::fs::canonicalize(&device).ok())
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| card.display().to_string());
    let driver = (std::fs::read_link(device.join("driver")).ok())
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_default();
    let gpu = if vendor == GpuVendor::Amd.pci_id() {
        let memory_mib = match read_trimmed(&device.join("mem_info_vram_total")) {
            Some(text) => {
                text.parse::<u64>()
                    .map_err(|_| format!("mem_info_vram_total {text:?} is not a number of bytes"))?
                    >> 20
            }
            None => 0,
        };
        let arch = render_minor(&device).and_then(|minor| targets.get(&minor).cloned());
        let name = read_trimmed(&device.join("product_name"))
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| match &arch {
                Some(gfx) => format!("AMD Radeon ({gfx})"),
                None => format!("AMD GPU {id:#06x}"),
            });
        Accelerator {
            index: 0,
            name,
            uuid: read_trimmed(&device.join("unique_id")).unwrap_or_else(|| address.clone()),
            memory_mib,
            driver,
            vendor: GpuVendor::Amd,
            arch,
        }
    } else if vendor == GpuVendor::Intel.pci_id() {
        let Some(name) = intel_discrete(id) else {
            return Ok(None);
        };
        Accelerator {
            index: 0,
            name,
            uuid: address.clone(),
            memory_mib: 0,
            driver,
            vendor: GpuVendor::Intel,
            arch: None,
        }
    } else {
        return Ok(None);
    };
    Ok(Some((address, gpu)))
}

/// Intel's discrete GPUs by PCI device id (integrated graphics are no accelerator here):
/// Alchemist and Flex (DG2), Battlemage, and the Data Center GPU Max (Ponte Vecchio).
fn intel_discrete(id: u16) -> Option<String> {
    let named = match id {
        0x56a0 => "Intel Arc A770",
        0x56a1 => "Intel Arc A750",
        0x56a5 => "Intel Arc A380",
        0x56c0 => "Intel Data Center GPU Flex 170",
        0x56c1 => "Intel Data Center GPU Flex 140",
        0xe20b => "Intel Arc B580",
        0xe20c => "Intel Arc B570",
        0x0bd5 => "Intel Data Center GPU Max 1550",
        0x0bda => "Intel Data Center GPU Max 1100",
        0x56a2..=0x56bf | 0x56c2 => return Some(format!("Intel Arc {id:#06x}")),
        0xe202..=0xe212 => return Some(format!("Intel Arc {id:#06x}")),
        0x0bd0..=0x0bdb => return Some(format!("Intel Data Center GPU Max {id:#06x}")),
        _ => return None,
    };
    Some(named.to_string())
}

/// The render node's minor number of a device (`device/drm/renderD128` is 128).
fn render_minor(device: &Path) -> Option<u32> {
    std::fs::read_dir(device.join("drm"))
        .ok()?
        .flatten()
        .find_map(|e| {
            e.file_name()
                .to_str()?
                .strip_prefix("renderD")?
                .parse()
                .ok()
        })
}

/// AMD's `gfx` targets by render minor, from the KFD topology: `gfx_target_version` is
/// major * 10000 + minor * 100 + stepping, and the target names the stepping in hex
/// (90010 is gfx90a, 120001 gfx1201).
fn kfd_targets(sysfs: &Path) -> BTreeMap<u32, String> {
    let mut targets = BTreeMap::new();
    let Ok(nodes) = std::fs::read_dir(sysfs.join("class/kfd/kfd/topology/nodes")) else {
        return targets;
    };
    for node in nodes.flatten() {
        let Ok(text) = std::fs::read_to_string(node.path().join("properties")) else {
            continue;
        };
        let field = |key: &str| {
            text.lines().find_map(|l| {
                let (k, v) = l.split_once(' ')?;
                (k == key).then(|| v.trim().parse::<u64>().ok()).flatten()
            })
        };
        let (Some(version), Some(minor)) = (field("gfx_target_version"), field("drm_render_minor"))
        else {
            continue;
        };
        if version == 0 {
            continue; // a CPU node
        }
        let (major, minor_v, stepping) = (version / 10000, version / 100 % 100, version % 100);
        targets.insert(minor as u32, format!("gfx{major}{minor_v}{stepping:x}"));
    }
    targets
}

/// Names AMD's GPUs as `rocm-smi --showproductname --showuniqueid --showbus --json` does,
/// matched by PCI address; its `GFX Version` fills a target the KFD did not give.
pub fn name_from_rocm_smi(gpus: &mut [(String, Accelerator)], json: &str) {
    let Ok(serde_json::Value::Object(cards)) = serde_json::from_str::<serde_json::Value>(json)
    else {
        warn_once(
            "rocm-smi's answer is not a JSON object; AMD's GPUs keep the kernel's names".into(),
        );
        return;
    };
    for card in cards.values() {
        let Some(fields) = card.as_object() else {
            continue;
        };
        // Its key names changed case between releases ("Card series", "Card Series").
        let get = |key: &str| {
            fields
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(key))
                .and_then(|(_, v)| v.as_str())
                .map(str::trim)
                .filter(|v| !v.is_empty() && *v != "N/A")
        };
        let Some(bus) = get("PCI Bus") else { continue };
        let Some((_, gpu)) = gpus
            .iter_mut()
            .find(|(address, _)| address.eq_ignore_ascii_case(bus))
        else {
            continue;
        };
        if let Some(series) = get("Card Series") {
            gpu.name = series.to_string();
        }
        if let Some(id) = get("Unique ID") {
            gpu.uuid = id.to_string();
        }
        if gpu.arch.is_none() {
            gpu.arch = get("GFX Version").map(str::to_string);
        }
    }
}

fn read_trimmed(path: &Path) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_string())
}

fn hex_id(text: &str) -> Option<u16> {
    u16::from_str_radix(text.strip_prefix("0x")?, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_nvidia_smi_csv() {
        let got = parse_nvidia_smi(
            "0, NVIDIA H100 80GB HBM3, GPU-aaaa, 81559, 550.54.15\n\
             garbage line\n\
             1, NVIDIA H100 80GB HBM3, GPU-bbbb, 81559, 550.54.15\n",
        );
        assert_eq!(got.len(), 2);
        assert_eq!(got[1].uuid, "GPU-bbbb");
        assert_eq!(got[0].memory_mib, 81559);
        assert_eq!(got[0].vendor, GpuVendor::Nvidia);
    }

    #[test]
    fn a_gfx_target_version_names_its_target() {
        let dir = tempfile::tempdir().unwrap();
        for (n, version, minor) in [
            (0, 0, 0),
            (1, 120001, 128),
            (2, 90010, 129),
            (3, 90402, 130),
        ] {
            let node = dir.path().join(format!("class/kfd/kfd/topology/nodes/{n}"));
            std::fs::create_dir_all(&node).unwrap();
            std::fs::write(
                node.join("properties"),
                format!(
                    "cpu_cores_count 0\ngfx_target_version {version}\ndrm_render_minor {minor}\n"
                ),
            )
            .unwrap();
        }
        let targets = kfd_targets(dir.path());
        assert_eq!(
            targets.into_iter().collect::<Vec<_>>(),
            [
                (128, "gfx1201".into()),
                (129, "gfx90a".into()),
                (130, "gfx942".into())
            ]
        );
    }

    #[test]
    fn rocm_smi_names_the_card_at_its_address() {
        let amd = Accelerator {
            index: 0,
            name: "AMD GPU 0x74a1".into(),
            uuid: "0000:05:00.0".into(),
            memory_mib: 196_288,
            driver: "amdgpu".into(),
            vendor: GpuVendor::Amd,
            arch: None,
        };
        let mut gpus = vec![("0000:05:00.0".to_string(), amd)];
        name_from_rocm_smi(
            &mut gpus,
            r#"{"card0": {"Card Series": "AMD Instinct MI300X OAM", "Card Model": "0x74a1",
                "Unique ID": "0x18e2a9d6f3c4b1e0", "PCI Bus": "0000:05:00.0", "GFX Version": "gfx942"},
               "card9": {"Card series": "elsewhere", "PCI Bus": "0000:99:00.0"}}"#,
        );
        let gpu = &gpus[0].1;
        assert_eq!(
            (gpu.name.as_str(), gpu.uuid.as_str(), gpu.arch.as_deref()),
            (
                "AMD Instinct MI300X OAM",
                "0x18e2a9d6f3c4b1e0",
                Some("gfx942")
            )
        );
        name_from_rocm_smi(&mut gpus, "not json");
        assert_eq!(gpus[0].1.name, "AMD Instinct MI300X OAM", "unchanged");
    }
}
