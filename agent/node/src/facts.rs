//! Gathering what a machine is: architecture, CPUs, memory, free disk under the run store, kernel, OS,
//! agent version and accelerators (from `nvidia-smi`, whose path is configurable).
use fleet_proto::facts::{Accelerator, Facts};
use std::path::Path;
use std::time::Duration;

pub const NVIDIA_SMI_ARGS: [&str; 2] = [
    "--query-gpu=index,name,uuid,memory.total,driver_version",
    "--format=csv,noheader,nounits",
];

/// Gathers the facts; a missing or failing accelerator tool means "no accelerators", never a crash.
pub async fn collect(run_store: &Path, accelerator_tool: &Path) -> Facts {
    Facts {
        arch: std::env::consts::ARCH.to_string(),
        cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        memory_bytes: mem_total().unwrap_or(0),
        disk_free_bytes: disk_free(run_store).unwrap_or(0),
        kernel: rustix::system::uname()
            .release()
            .to_string_lossy()
            .into_owned(),
        os: os_name().unwrap_or_else(|| "unknown".into()),
        agent_version: env!("CARGO_PKG_VERSION").to_string(),
        accelerators: accelerators(accelerator_tool).await,
    }
}

fn mem_total() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Free bytes on the filesystem that holds (or will hold) the run store.
fn disk_free(run_store: &Path) -> Option<u64> {
    let existing = run_store.ancestors().find(|p| p.exists())?;
    let st = rustix::fs::statvfs(existing).ok()?;
    Some(st.f_bavail * st.f_frsize)
}

fn os_name() -> Option<String> {
    let text = std::fs::read_to_string("/etc/os-release").ok()?;
    let field = |key: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(key))
            .map(|v| v.trim_matches('"').to_string())
    };
    field("PRETTY_NAME=").or_else(|| field("NAME="))
}

async fn accelerators(tool: &Path) -> Vec<Accelerator> {
    let run = tokio::process::Command::new(tool)
        .args(NVIDIA_SMI_ARGS)
        .kill_on_drop(true)
        .output();
    match tokio::time::timeout(Duration::from_secs(10), run).await {
        Ok(Ok(out)) if out.status.success() => {
            parse_nvidia_smi(&String::from_utf8_lossy(&out.stdout))
        }
        Ok(Ok(out)) => {
            tracing::warn!(tool = %tool.display(), status = %out.status, "the accelerator tool failed; reporting no accelerators");
            Vec::new()
        }
        Ok(Err(e)) => {
            tracing::info!(tool = %tool.display(), error = %e, "no accelerator tool; reporting no accelerators");
            Vec::new()
        }
        Err(_) => {
            tracing::warn!(tool = %tool.display(), "the accelerator tool hung for 10 s; reporting no accelerators");
            Vec::new()
        }
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
            })
        })
        .collect()
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
    }
}

/// Where the facts come from on this machine.
#[derive(Debug, Clone)]
pub struct FactsSource {
    pub run_store: std::path::PathBuf,
    pub accelerator_tool: std::path::PathBuf,
}

impl FactsSource {
    pub async fn collect(&self) -> Facts {
        collect(&self.run_store, &self.accelerator_tool).await
    }
}
