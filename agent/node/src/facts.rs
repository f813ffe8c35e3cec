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
        max_runs: None,
        memory_bytes: mem_total().unwrap_or(0),
        disk_free_bytes: disk_free(run_store).unwrap_or(0),
        kernel: rustix::system::uname()
            .release()
            .to_string_lossy()
            .into_owned(),
        os: os_name().unwrap_or_else(|| "unknown".into()),
        agent_version: env!("CARGO_PKG_VERSION").to_string(),
        accelerators: accelerators(accelerator_tool).await,
        measured_link: None,
        release: None,
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
    /// Artifact copies timed on this machine.
    pub link: std::sync::Arc<LinkMeter>,
    /// `--max-runs`: how many runs it takes at once (None: one per CPU).
    pub max_runs: Option<u32>,
    /// Where its releases live: the release it runs and how its last update went.
    pub releases: Option<crate::update::Releases>,
}

impl FactsSource {
    pub async fn collect(&self) -> Facts {
        let mut facts = collect(&self.run_store, &self.accelerator_tool).await;
        // One run per CPU unless told otherwise: the coordinator queues the rest.
        facts.max_runs = Some(self.max_runs.unwrap_or(facts.cpus.max(1) as u32));
        facts.measured_link = self.link.published(std::time::Instant::now());
        facts.release = self.releases.as_ref().map(|r| r.facts());
        facts
    }
}

/// How long a link reading stands after the last copy was timed.
pub const LINK_VALID: std::time::Duration = std::time::Duration::from_secs(3600);

/// The slowest whole artifact copy rate seen, and when the last copy was timed (monotonic).
#[derive(Debug, Default)]
pub struct LinkMeter(std::sync::Mutex<Option<(u64, std::time::Instant)>>);

impl LinkMeter {
    /// Records one copy's rate, timed at `at`; readings older than [`LINK_VALID`] are forgotten.
    pub fn record(&self, bytes_per_s: u64, at: std::time::Instant) {
        let mut reading = self.0.lock().expect("link meter");
        let slowest = match *reading {
            Some((slowest, last)) if at.saturating_duration_since(last) < LINK_VALID => {
                slowest.min(bytes_per_s)
            }
            _ => bytes_per_s,
        };
        *reading = Some((slowest, at));
    }

    /// The measured link as of `now`, or None an hour after the last reading.
    pub fn published(&self, now: std::time::Instant) -> Option<fleet_proto::facts::MeasuredLink> {
        let (slowest, last) = (*self.0.lock().expect("link meter"))?;
        let age = now.saturating_duration_since(last);
        (age < LINK_VALID).then(|| fleet_proto::facts::MeasuredLink {
            bytes_per_s: slowest,
            age_ms: age.as_millis() as u64,
            valid_for_ms: (LINK_VALID - age).as_millis() as u64,
            confidence: 0.9,
            basis: "whole_copy".into(),
        })
    }
}

#[cfg(test)]
mod link_tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn the_slowest_copy_is_published_for_an_hour_after_the_last() {
        let meter = LinkMeter::default();
        let t0 = Instant::now();
        assert_eq!(meter.published(t0), None, "no copy, no link");
        meter.record(300, t0);
        meter.record(100, t0 + Duration::from_secs(60));
        meter.record(200, t0 + Duration::from_secs(120));
        let at = t0 + Duration::from_secs(180);
        let link = meter.published(at).unwrap();
        assert_eq!(
            (
                link.bytes_per_s,
                link.age_ms,
                link.valid_for_ms,
                link.confidence
            ),
            (100, 60_000, 3_540_000, 0.9)
        );
        assert_eq!(link.basis, "whole_copy");
        let expired = t0 + Duration::from_secs(120) + LINK_VALID;
        assert_eq!(
            meter.published(expired),
            None,
            "an hour after the last reading"
        );
        meter.record(500, expired);
        assert_eq!(
            meter.published(expired).unwrap().bytes_per_s,
            500,
            "starts afresh"
        );
    }
}
