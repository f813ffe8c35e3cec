//! `cargo xtask bench rollout --nodes N`: one coordinator and N simulated nodes
//! (`fleet-loadgen`, the real protocol), a release signed and taken in as an operator does it
//! (`fleet-coordinator release keygen/certify/sign/trust/add`), then `rollout start` with 5
//! canaries and waves of 1%, 10%, 50% and 100% with no wait between them. Each node fetches the
//! release's binaries for its target by digest on the agent's content path and reports the swap
//! as kept, without exec'ing anything. Measures the time from `rollout start` to `done`, the
//! coordinator's CPU and peak RSS meanwhile, and the bytes of binaries the nodes fetched.
//!
//! No peer runs beside it: none of the updaters the issue names (Teleport's, Tailscale's,
//! Bottlerocket's) can be driven against simulated nodes here, so the figures stand alone.
use super::fleet::{Bench, HEARTBEAT, StoreKind, TARGET, cpu_seconds, release};
use crate::util::record_benchmark;
use anyhow::{Result, bail};
use serde_json::Value;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// The stand-in binaries' size: the figure is the controller's and the protocol's, and bytes
/// served grow with it linearly (a real agent is some MiB, which 10 000 nodes on one loopback
/// would spend minutes copying).
const BINARY_BYTES: usize = 64 << 10;

pub fn run(nodes: usize) -> Result<()> {
    let bench = Bench::start(&release()?, nodes, 1, StoreKind::Redb, false, &[])?;
    std::thread::sleep(HEARTBEAT * 2);
    let idle_kib = bench.rss_kib()?;
    let coord = &bench.coords[0];
    let keys = bench.work.join("keys");
    std::fs::create_dir_all(&keys)?;
    let s = |p: &Path| p.display().to_string();
    let root = coord.cli(&["release", "keygen", "--out", &s(&keys.join("root.key"))])?;
    let key = coord.cli(&["release", "keygen", "--out", &s(&keys.join("release.key"))])?;
    coord.cli(&[
        "release",
        "certify",
        "--root",
        &s(&keys.join("root.key")),
        "--key",
        key.trim(),
        "--out",
        &s(&keys.join("release.key.cert")),
    ])?;
    let dist = bench.work.join("release");
    for arch in ["x86_64", "arm64"] {
        bundle(&dist, arch)?;
    }
    coord.cli(&[
        "release",
        "sign",
        "--key",
        &s(&keys.join("release.key")),
        "--cert",
        &s(&keys.join("release.key.cert")),
        "--dir",
        &s(&dist),
        "--sequence",
        "1",
    ])?;
    coord.cli(&["release", "trust", "--root", root.trim()])?;
    coord.cli(&["release", "add", &s(&dist)])?;

    let cpu0 = cpu_seconds(&bench.pids)?;
    let started = Instant::now();
    coord.cli(&[
        "rollout",
        "start",
        "--release",
        "1",
        "--canaries",
        "5",
        "--waves",
        "1%,10%,50%,100%",
        "--wait",
        "0s",
        "--halt-at",
        "5%",
    ])?;
    let mut peak_kib = idle_kib;
    let status = loop {
        peak_kib = peak_kib.max(bench.rss_kib()?);
        let status: Value = serde_json::from_str(&coord.cli(&["rollout", "status", "--json"])?)?;
        match status["state"].as_str() {
            Some("done") => break status,
            Some("running") => {}
            other => bail!("the rollout stopped {other:?}: {status}"),
        }
        if started.elapsed() > Duration::from_secs(600) {
            bail!("the rollout was not done within 10 minutes");
        }
        std::thread::sleep(Duration::from_millis(250));
    };
    let done_s = started.elapsed().as_secs_f64();
    let cpu_s = cpu_seconds(&bench.pids)? - cpu0;
    let machines = status["machines"].as_object().map_or(0, |m| m.len());
    // The loadgen prints its counters once a second: wait for the line that follows the last swap.
    let counted = Instant::now();
    while bench.counter("updated")? < machines as u64 && counted.elapsed() < Duration::from_secs(5)
    {
        std::thread::sleep(Duration::from_millis(250));
    }
    let (updated, bytes) = (bench.counter("updated")?, bench.counter("update_bytes")?);
    bench.stop();
    let markdown = format!(
        "## rollout: one release to {nodes} nodes\n\n\
         `cargo xtask bench rollout --nodes {nodes}`: one `fleet-coordinator serve` (static \
         `{TARGET}` release, embedded redb store, metrics listener off) and {nodes} simulated nodes \
         from `fleet-loadgen` on loopback. A release signed and taken in as an operator does it, \
         whose binaries are stand-ins of {kib} KiB each; then `rollout start --canaries 5 --waves \
         1%,10%,50%,100% --wait 0s`. Each node fetches its target's two binaries by digest on the \
         agent's content path and reports the swap as kept without exec'ing. No peer: none of the \
         updaters named in issue 23 can be driven against simulated nodes here. One run, on one \
         machine of 2 cores shared by every process.\n\n\
         | figure | value | target (issue 23) |\n\
         |---|---|---|\n\
         | from `rollout start` to `done`, every node on the release | {done_s:.1} s | < 60 s for 10 000 |\n\
         | machines in the rollout / nodes that took the release | {machines} / {updated} | {nodes} / {nodes} |\n\
         | coordinator CPU over the rollout | {cpu_s:.1} s ({share:.0}% of one core) | |\n\
         | coordinator peak RSS during the rollout / idle with every session held | {peak:.1} MiB / {idle:.1} MiB ({ratio:.2}x) | <= 1.5x |\n\
         | bytes of binaries the nodes fetched (each binary once per node) | {mib:.1} MiB ({per:.0} KiB a node) | |\n",
        kib = BINARY_BYTES >> 10,
        share = cpu_s / done_s * 100.0,
        peak = peak_kib as f64 / 1024.0,
        idle = idle_kib as f64 / 1024.0,
        ratio = peak_kib as f64 / idle_kib.max(1) as f64,
        mib = bytes as f64 / (1 << 20) as f64,
        per = bytes as f64 / 1024.0 / updated.max(1) as f64,
    );
    println!("{markdown}");
    record_benchmark(&format!("rollout-{nodes}"), &markdown)
}

/// A bundle of stand-in binaries for `arch`, each different, packed as `cargo xtask dist` packs.
fn bundle(dist: &Path, arch: &str) -> Result<()> {
    let staging = dist.join(format!("staging-{arch}"));
    std::fs::create_dir_all(&staging)?;
    for name in ["fleet-agent", "fleet-run-supervisor"] {
        let mut bytes = format!("{name} for {arch}\n").into_bytes();
        bytes.resize(BINARY_BYTES, b'.');
        std::fs::write(staging.join(name), bytes)?;
    }
    let script = format!(
        "tar -C {staging} -cf - . | gzip -n > {dist}/hub-linux-{arch}.tar.gz",
        staging = staging.display(),
        dist = dist.display()
    );
    if !Command::new("sh").arg("-c").arg(script).status()?.success() {
        bail!("packing the {arch} bundle failed");
    }
    std::fs::remove_dir_all(&staging)?;
    Ok(())
}
