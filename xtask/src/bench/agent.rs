//! `cargo xtask bench agent`: the static agent's idle memory after joining, its time from start
//! to `Joined` on loopback, its stripped binary size, and the time to dispatch 1 000 short runs to
//! one agent and receive every result, each beside a peer measured in the same run.
use crate::cross;
use crate::fleet::{self, Coordinator, wait_for_line};
use crate::util::{measure, median, proc_status_kib, record_benchmark};
use anyhow::{Context, Result, bail};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const TARGET: &str = "x86_64-unknown-linux-musl";
const SAMPLES: usize = 10;
const DISPATCH_RUNS: usize = 1000;
/// How long the agent idles (heartbeating) before its memory is read.
const IDLE: Duration = Duration::from_secs(2);

pub fn run() -> Result<()> {
    cross::build_static(
        TARGET,
        &["fleet-agent", "fleet-coordinator", "fleet-run-supervisor"],
    )?;
    let bin = cross::target_dir().join(TARGET).join("release/fleet-agent");
    let size = std::fs::metadata(&bin)
        .with_context(|| format!("cannot find {}", bin.display()))?
        .len();
    let work = fleet::fresh_dir("bench-agent")?;
    let mut coordinator = Coordinator::serve(
        &bin,
        &work.join("coord"),
        &["--heartbeat", "500ms"],
        Stdio::null(),
    )?;

    let mut joined_ms = Vec::new();
    let mut rss_kib = Vec::new();
    for i in 0..SAMPLES {
        let (ms, rss) = join_once(&bin, &coordinator, &work.join(format!("m{i}")))?;
        joined_ms.push(ms);
        rss_kib.push(rss as f64);
    }
    let mut curl_ms = Vec::new();
    let url = format!(
        "http://{}/bundles/hub-linux-x86_64.tar.gz",
        coordinator.addr
    );
    for _ in 0..SAMPLES {
        let m = measure(
            Command::new("curl")
                .args(["-s", "-o", "/dev/null", &url])
                .stdout(Stdio::null()),
        )?;
        curl_ms.push(m.seconds * 1000.0);
    }
    let (dispatch_s, direct_s) = dispatch(&bin, &coordinator, &work)?;
    coordinator.stop();

    let (joined, curl, rss) = (
        median(&joined_ms),
        median(&curl_ms),
        median(&rss_kib) / 1024.0,
    );
    let size_mib = size as f64 / (1024.0 * 1024.0);
    let markdown = format!(
        "## agent\n\n\
         `cargo xtask bench agent`: the static `{TARGET}` release build (`cargo zigbuild --release \
         --target {TARGET} -p fleet-agent`), a coordinator and the agent on loopback, median of \
         {SAMPLES} fresh machines (new state folder, new token each).\n\n\
         | figure | fleet-agent | target | beside it |\n\
         |---|---|---|---|\n\
         | resident memory, idle {idle} s after joining | {rss:.1} MiB | <= 15 MiB | tailscaled: 26 to 40 MiB as reported (not measured here) |\n\
         | start to `Joined` (new key, TLS join, record, secrets removed) | {joined:.1} ms | <= 100 ms | a fresh `curl` doing one HTTP request on the same port: {curl:.1} ms |\n\
         | stripped static binary | {size_mib:.2} MiB | <= 10 MiB | |\n\
         | dispatch {DISPATCH_RUNS} short runs to one agent and receive every result | {dispatch_s:.1} s | <= 20 s | the same runs through `fleet-run-supervisor start` + `wait` directly, one after another: {direct_s:.1} s |\n\n\
         Ratio start-to-Joined / curl: {ratio:.1}x. Ratio dispatch / direct supervisor: {dratio:.2}x \
         (the agent path adds the session, the durable op and event records on both sides).\n",
        idle = IDLE.as_secs(),
        ratio = joined / curl,
        dratio = dispatch_s / direct_s,
    );
    println!("{markdown}");
    record_benchmark("agent", &markdown)
}

/// Starts one fresh agent; returns (milliseconds to `Joined`, idle RSS in KiB).
fn join_once(bin: &Path, coordinator: &Coordinator, dir: &Path) -> Result<(f64, u64)> {
    std::fs::create_dir_all(dir)?;
    let join = dir.join("fleet.json");
    std::fs::write(&join, coordinator.cli(&["token"])?)?;
    let start = Instant::now();
    let mut child = fleet::agent(bin, &join, dir)
        .arg("--head-less")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("cannot start the agent")?;
    let mut lines = BufReader::new(child.stderr.take().expect("piped")).lines();
    if let Err(e) = wait_for_line(&mut lines, "Joined") {
        let _ = child.kill();
        let _ = child.wait();
        return Err(e);
    }
    let joined = start.elapsed();
    // Keep draining its log so it never blocks on a full pipe while idling.
    let drain = std::thread::spawn(move || lines.for_each(drop));
    std::thread::sleep(IDLE);
    let rss = proc_status_kib(child.id(), "VmRSS")?;
    let _ = child.kill();
    let _ = child.wait();
    let _ = drain.join();
    Ok((joined.as_secs_f64() * 1000.0, rss))
}

/// Seconds to run DISPATCH_RUNS `exit 0` programs through the coordinator and one fresh agent
/// until every row is final, and the same count through the supervisor directly.
fn dispatch(bin: &Path, coordinator: &Coordinator, work: &Path) -> Result<(f64, f64)> {
    let dir = work.join("dispatch");
    std::fs::create_dir_all(&dir)?;
    let program = dir.join("true.sh");
    std::fs::write(&program, "#!/bin/sh\nexit 0\n")?;
    let join = dir.join("fleet.json");
    std::fs::write(&join, coordinator.cli(&["token"])?)?;
    let mut agent = fleet::Proc::spawn(
        fleet::agent(bin, &join, &dir)
            .arg("--head-less")
            .stdout(Stdio::null())
            .stderr(Stdio::piped()),
    )?;
    let mut lines = BufReader::new(agent.0.stderr.take().expect("piped")).lines();
    wait_for_line(&mut lines, "session open")?;
    let drain = std::thread::spawn(move || lines.for_each(drop));
    let coord = |args: &[&str]| coordinator.cli(args);
    // The node id, so only this agent gets the runs.
    let nodes: serde_json::Value = serde_json::from_str(&coord(&["nodes", "--json"])?)?;
    let node = nodes
        .as_array()
        .and_then(|n| n.iter().rev().find(|n| n["state"] == "Joined"))
        .and_then(|n| n["id"].as_str())
        .context("the dispatch agent is not listed")?
        .to_string();
    let start = Instant::now();
    let repeat = DISPATCH_RUNS.to_string();
    let program_arg = program.to_string_lossy().into_owned();
    let set = coord(&[
        "run",
        "--node",
        &node,
        "--repeat",
        &repeat,
        "--program",
        &program_arg,
    ])?;
    let rows: serde_json::Value = serde_json::from_str(&coord(&[
        "status",
        "--set",
        set.trim(),
        "--poll",
        "--json",
    ])?)?;
    let dispatch_s = start.elapsed().as_secs_f64();
    let finished = rows
        .as_array()
        .map_or(0, |r| r.iter().filter(|r| r["state"] == "finished").count());
    agent.stop();
    let _ = drain.join();
    if finished != DISPATCH_RUNS {
        bail!("only {finished} of {DISPATCH_RUNS} runs finished");
    }

    let supervisor = bin.with_file_name("fleet-run-supervisor");
    let root = dir.join("direct");
    let sup = |args: &[&str]| -> Result<String> {
        let out = Command::new(&supervisor)
            .arg("--root")
            .arg(&root)
            .args(args)
            .output()?;
        if !out.status.success() {
            bail!(
                "fleet-run-supervisor {args:?} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let digest = sup(&["stage", &program_arg])?.trim().to_string();
    let start = Instant::now();
    for i in 0..DISPATCH_RUNS {
        let run = format!("direct-{i}");
        sup(&["start", "--run", &run, "--program", &digest])?;
        sup(&["wait", "--run", &run])?;
    }
    Ok((dispatch_s, start.elapsed().as_secs_f64()))
}
