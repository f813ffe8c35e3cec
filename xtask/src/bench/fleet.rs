//! `cargo xtask bench fleet --nodes N`: one coordinator on its embedded store and N simulated nodes
//! (`fleet-loadgen`, the real protocol: keys, pinned TLS, join, sessions, heartbeats, answers) on
//! loopback. Measures the time for all to join, the coordinator's memory per live node, its CPU
//! per heartbeat at a steady 5 s heartbeat, and one run dispatched to every node with every result
//! back, with the coordinator's memory while dispatching.
use crate::cross;
use crate::fleet::{self, Coordinator, Proc};
use crate::util::{proc_status_kib, record_benchmark};
use anyhow::{Context, Result, bail};
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const TARGET: &str = "x86_64-unknown-linux-musl";
const HEARTBEAT: Duration = Duration::from_secs(5);
/// How long the steady heartbeat is watched for its CPU cost.
const STEADY: Duration = Duration::from_secs(30);

pub fn run(nodes: usize) -> Result<()> {
    cross::build_static(TARGET, &["fleet-coordinator", "fleet-loadgen"])?;
    let release = cross::target_dir().join(TARGET).join("release");
    let work = fleet::fresh_dir("bench-fleet")?;
    let heartbeat = format!("{}s", HEARTBEAT.as_secs());
    let mut coordinator = Coordinator::serve(
        &release.join("fleet-coordinator"),
        &work.join("coord"),
        &["--heartbeat", &heartbeat, "--lease", "30s"],
        Stdio::null(),
    )?;
    let pid = coordinator.pid();
    let joins = work.join("joins.jsonl");
    std::fs::write(
        &joins,
        coordinator.cli(&["token", "--count", &nodes.to_string()])?,
    )?;
    let empty_kib = proc_status_kib(pid, "VmRSS")?;

    let mut loadgen = Proc::spawn(
        Command::new(release.join("fleet-loadgen"))
            .arg("--join-files")
            .arg(&joins)
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(work.join("loadgen.log"))?),
    )?;
    let counters = counter_lines(&mut loadgen);
    let all = nodes as u64;
    let joined = wait_for(&counters, |c| c["sessions"].as_u64() >= Some(all), 600)?;
    let join_s = joined["elapsed_ms"].as_f64().unwrap_or(0.0) / 1000.0;

    // Steady state: every node heartbeating; memory and CPU of the coordinator alone.
    std::thread::sleep(HEARTBEAT * 2);
    let idle_kib = proc_status_kib(pid, "VmRSS")?;
    let (cpu0, beats0) = (
        cpu_seconds(pid)?,
        latest(&counters)?["heartbeats"].as_u64().unwrap_or(0),
    );
    std::thread::sleep(STEADY);
    let (cpu1, beats1) = (
        cpu_seconds(pid)?,
        latest(&counters)?["heartbeats"].as_u64().unwrap_or(0),
    );
    let beats = beats1.saturating_sub(beats0).max(1);
    let cpu_us_per_beat = (cpu1 - cpu0) * 1e6 / beats as f64;
    let core_share = (cpu1 - cpu0) / STEADY.as_secs_f64() * 100.0;

    // One run to every node, until every row is final.
    let program = work.join("true.sh");
    std::fs::write(&program, "#!/bin/sh\nexit 0\n")?;
    let started = Instant::now();
    let set = coordinator.run_set(&program, &[])?;
    let mut peak_kib = idle_kib;
    let dispatch_s = loop {
        peak_kib = peak_kib.max(proc_status_kib(pid, "VmRSS")?);
        let rows: Vec<Value> =
            serde_json::from_str(&coordinator.cli(&["status", "--set", &set, "--json"])?)?;
        if rows.len() == nodes && rows.iter().all(|r| r["state"] == "finished") {
            break started.elapsed().as_secs_f64();
        }
        if started.elapsed() > Duration::from_secs(600) {
            bail!("the {nodes} runs did not all finish within 10 minutes");
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    loadgen.stop();
    coordinator.stop();

    let per_node = (idle_kib.saturating_sub(empty_kib)) as f64 / nodes as f64;
    let markdown = format!(
        "## fleet\n\n\
         `cargo xtask bench fleet --nodes {nodes}`: one `fleet-coordinator serve` (static `{TARGET}` \
         release, embedded redb store, heartbeat {hb} s) and {nodes} simulated nodes from \
         `fleet-loadgen` in one process on loopback, each with its own Ed25519 key, the pinned TLS \
         join, a session with facts and heartbeats, and answers to starts (reported `running` and \
         `finished` without running anything). One run each, on one machine of 2 cores shared by \
         both processes.\n\n\
         | figure | value | target (issue 14) |\n\
         |---|---|---|\n\
         | all {nodes} nodes joined and in session | {join_s:.1} s | |\n\
         | coordinator RSS, no node / {nodes} idle nodes | {empty:.1} MiB / {idle:.1} MiB | |\n\
         | coordinator RSS per live node | {per_node:.1} KiB | <= 32 KiB |\n\
         | coordinator CPU per heartbeat (over {steady} s, {beats} heartbeats) | {cpu_us_per_beat:.0} µs | <= 50 µs |\n\
         | coordinator CPU at a steady {hb} s heartbeat | {core_share:.0}% of one core | |\n\
         | one run to each node, dispatched and every result back | {dispatch_s:.1} s | < 30 s for 10 000 |\n\
         | coordinator peak RSS while dispatching / idle | {peak:.1} MiB ({ratio:.2}x) | <= 2x |\n",
        hb = HEARTBEAT.as_secs(),
        empty = empty_kib as f64 / 1024.0,
        idle = idle_kib as f64 / 1024.0,
        steady = STEADY.as_secs(),
        peak = peak_kib as f64 / 1024.0,
        ratio = peak_kib as f64 / idle_kib.max(1) as f64,
    );
    println!("{markdown}");
    record_benchmark("fleet", &markdown)
}

/// The loadgen's counter lines, parsed, as they arrive.
fn counter_lines(loadgen: &mut Proc) -> mpsc::Receiver<Value> {
    let stdout = loadgen.0.stdout.take().expect("piped");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Ok(v) = serde_json::from_str(&line)
                && tx.send(v).is_err()
            {
                return;
            }
        }
    });
    rx
}

/// The first counter line that passes `check`, within `seconds`.
fn wait_for(
    lines: &mpsc::Receiver<Value>,
    check: impl Fn(&Value) -> bool,
    seconds: u64,
) -> Result<Value> {
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let mut last = Value::Null;
    while Instant::now() < deadline {
        match lines.recv_timeout(Duration::from_secs(5)) {
            Ok(v) if check(&v) => return Ok(v),
            Ok(v) => last = v,
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                bail!("fleet-loadgen stopped; last counters {last}")
            }
        }
    }
    bail!("the simulated nodes did not get there in {seconds} s; last counters {last}")
}

/// The newest counter line (they come once a second).
fn latest(lines: &mpsc::Receiver<Value>) -> Result<Value> {
    let mut newest = lines
        .recv_timeout(Duration::from_secs(5))
        .context("no counters from fleet-loadgen")?;
    while let Ok(v) = lines.try_recv() {
        newest = v;
    }
    Ok(newest)
}

/// User plus system CPU seconds a process has used.
fn cpu_seconds(pid: u32) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command (which may hold spaces) start after its closing parenthesis.
    let rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .context("a malformed /proc/PID/stat")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = fields[11].parse::<f64>()? + fields[12].parse::<f64>()?;
    // SAFETY: sysconf reads a constant of the running kernel.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Ok(ticks / hz)
}
