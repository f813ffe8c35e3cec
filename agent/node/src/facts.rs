//! Gathering what a machine is: architecture, CPUs, memory, free disk under the run store, kernel,
//! OS, agent version, GPUs ([`crate::gpus`]), the container engine and the content on hand.
use crate::gpus::GpuSources;
use fleet_proto::facts::Facts;
use fleet_proto::facts::{ContentInventory, EngineFacts};
use std::path::Path;

/// Gathers the machine's own facts; a missing or failing GPU source means "no GPUs", never a crash.
pub async fn collect(run_store: &Path, gpus: &GpuSources) -> Facts {
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
        accelerators: gpus.accelerators().await,
        measured_link: None,
        release: None,
        engine: None,
        content: None,
    }
}

fn mem_total() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Free bytes on the filesystem that holds (or will hold) the run store.
pub fn disk_free(run_store: &Path) -> Option<u64> {
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

/// Where the facts come from on this machine.
#[derive(Debug, Clone)]
pub struct FactsSource {
    pub run_store: std::path::PathBuf,
    pub gpus: GpuSources,
    /// Artifact copies timed on this machine.
    pub link: std::sync::Arc<LinkMeter>,
    /// `--max-runs`: how many runs it takes at once (None: one per CPU).
    pub max_runs: Option<u32>,
    /// Where its releases live: the release it runs and how its last update went.
    pub releases: Option<crate::update::Releases>,
}

impl FactsSource {
    /// The machine's facts with what the node holds (`held` reads its engine and its content).
    pub async fn collect(
        &self,
        held: impl FnOnce() -> (Option<EngineFacts>, ContentInventory) + Send + 'static,
    ) -> Facts {
        let mut facts = collect(&self.run_store, &self.gpus).await;
        // The engine's answers and the store's listings block; a hung engine must not hold the
        // session's heartbeats, so past ENGINE_PATIENCE the facts go without them.
        let asked = tokio::task::spawn_blocking(held);
        match tokio::time::timeout(ENGINE_PATIENCE, asked).await {
            Ok(Ok((engine, content))) => (facts.engine, facts.content) = (engine, Some(content)),
            Ok(Err(e)) => tracing::warn!("cannot read the engine and the content on hand: {e}"),
            Err(_) => tracing::warn!(
                "the engine and the content on hand took over {} s to read; these facts go without them",
                ENGINE_PATIENCE.as_secs()
            ),
        }
        // One run per CPU unless told otherwise: the coordinator queues the rest.
        facts.max_runs = Some(self.max_runs.unwrap_or(facts.cpus.max(1) as u32));
        facts.measured_link = self.link.published(std::time::Instant::now());
        facts.release = self.releases.as_ref().map(|r| r.facts());
        facts
    }
}

/// How long the facts wait for the engine's answers and the content listing.
const ENGINE_PATIENCE: std::time::Duration = std::time::Duration::from_secs(5);

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
