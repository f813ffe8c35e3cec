//! `cargo xtask bench flood [--rate N] [--sources K] [--seconds S] [--baseline REV]`: a serving
//! coordinator (release build) holding 20 sessions (simulated nodes of `fleet-loadgen`, the real
//! protocol, heartbeat 1 s) and one real agent, then S seconds of joins with a wrong token at N
//! connections a second from K loopback source addresses (`fleet-loadgen --flood`: the real
//! pinned TLS, one throwaway key), while a real agent with a good token joins from 127.0.0.1.
//! Measures the coordinator's CPU during the flood against idle (utime+stime from /proc), how
//! the attempts ended, the held sessions' heartbeat gaps as the coordinator heard them (its
//! `fleet_heartbeat_interval_seconds` histogram, before and after), a /healthz request's time
//! meanwhile, and the good agent's start to `Joined` and to its session. With `--baseline REV`
//! the same flood runs against the coordinator built from REV (`super::baseline`), side by side.
use super::baseline::Table;
use super::fleet::{get, metrics_addr, request_ms};
use crate::fleet::{self, Coordinator, Proc};
use crate::util::{self, proc_status_kib, record_benchmark};
use crate::{cross, util::median};
use anyhow::{Context, Result, bail};
use serde_json::Value;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Sessions held through the flood.
const SESSIONS: usize = 20;
const HEARTBEAT: &str = "1s";
const HEARTBEAT_S: f64 = 1.0;
/// The idle window the flood's CPU is compared with.
const IDLE: Duration = Duration::from_secs(10);
/// The histogram the coordinator keeps of the gaps between a session's heartbeats.
const GAPS: &str = "fleet_heartbeat_interval_seconds";

pub fn run(rate: u32, sources: u32, seconds: u64, baseline: Option<&str>) -> Result<()> {
    util::run(Command::new("cargo").args([
        "build",
        "--quiet",
        "--release",
        "-p",
        "fleet-coordinator",
        "-p",
        "fleet-agent",
        "-p",
        "fleet-loadgen",
    ]))?;
    let release = cross::target_dir().join("release");
    let work = fleet::fresh_dir("bench-flood")?;
    let flood = FloodArgs {
        rate,
        sources,
        seconds,
    };
    let mut columns = vec![(
        "this tree".to_string(),
        scenario(
            &release.join("fleet-coordinator"),
            &release,
            &work.join("this"),
            &flood,
        )?,
    )];
    if let Some(rev) = baseline {
        let baseline = super::baseline::build(rev, None, &["fleet-coordinator"])?;
        let coordinator = baseline.bin("fleet-coordinator");
        let figures = scenario(&coordinator, &release, &work.join("baseline"), &flood)?;
        columns.push((baseline.label(), figures));
    }
    let markdown = report(&flood, baseline, &columns);
    println!("{markdown}");
    // The default flood has its section; another rate or number of sources one of its own.
    let name = match (rate, sources) {
        (10_000, 64) => "flood".to_string(),
        _ => format!("flood-{rate}-{sources}"),
    };
    record_benchmark(&name, &markdown)
}

struct FloodArgs {
    rate: u32,
    sources: u32,
    seconds: u64,
}

/// What one run of the flood measured.
struct Figures {
    idle_cores: f64,
    flood_cores: f64,
    flood_s: f64,
    flooder_cores: f64,
    /// The flood's last counter line.
    counts: Value,
    /// Failed joins the coordinator served (its log's lines for them).
    served_failed_joins: usize,
    refusing_lines: usize,
    idle_gaps: Gaps,
    flood_gaps: Gaps,
    /// The held sessions at the end: live, and sessions opened in all (more than held: some
    /// were lost and opened again).
    held_live: u64,
    held_opened: u64,
    /// Lines of the agent joined before the flood saying its session was lost.
    agent_lost: usize,
    idle_join: Join,
    flood_join: Join,
    /// Connections the kernel dropped during the flood because a listen queue was full
    /// (`ListenOverflows` of /proc/net/netstat): the client retries its SYN after a second.
    overflows: u64,
    /// The host's connection tracking, when it has one: entries at the flood's start, at most,
    /// at its end; and the packets it dropped meanwhile, its table full.
    conntrack: Option<(u64, u64, u64)>,
    conntrack_dropped: Option<u64>,
    /// When into the flood a /healthz was asked, and how long its answer took.
    healthz_ms: Vec<(f64, f64)>,
    peak_rss_mib: f64,
}

/// A good agent's join: its own start-to-`Joined` (from its log line) and our wall time from
/// its start to `Joined` and to `session open`.
#[derive(Default, Clone, Copy)]
struct Join {
    agent_ms: u64,
    joined_ms: f64,
    session_ms: f64,
}

fn scenario(coordinator: &Path, tools: &Path, work: &Path, flood: &FloodArgs) -> Result<Figures> {
    std::fs::create_dir_all(work)?;
    let log = work.join("coordinator.log");
    let mut coord = Coordinator::serve(
        coordinator,
        &work.join("data"),
        &["--heartbeat", HEARTBEAT, "--lease", "10s"],
        Stdio::from(std::fs::File::create(&log)?),
    )?;
    let pid = coord.pid();
    fleet::wait_for_log(&log, "serving metrics on http://", Duration::from_secs(30))?;
    let metrics = metrics_addr(&log)?;

    // The held sessions: simulated nodes, one loadgen process.
    let holds = work.join("holds.jsonl");
    let minted = coord.cli(&["token", "--count", &SESSIONS.to_string(), "--ttl", "1h"])?;
    std::fs::write(&holds, minted)?;
    let mut held = Proc::spawn(
        Command::new(tools.join("fleet-loadgen"))
            .arg("--join-files")
            .arg(&holds)
            .args(["--duration", "1h"])
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(work.join("held.log"))?),
    )?;
    let held_lines = json_lines(&mut held, &work.join("held.jsonl"))?;
    let deadline = Instant::now() + Duration::from_secs(120);
    while newest(&held_lines)?["live"].as_u64() < Some(SESSIONS as u64) {
        if Instant::now() > deadline {
            bail!("the {SESSIONS} simulated nodes were not all in session within 2 minutes");
        }
    }

    // A real agent joins while all is quiet, and holds its session through the flood.
    let (mut quiet_agent, quiet_events) = agent(&coord, tools, &work.join("agent-idle"))?;
    let idle_join = timed_join(&quiet_events)?;

    let gaps0 = scrape(&metrics)?;
    let cpu0 = cpu_seconds(pid)?;
    std::thread::sleep(IDLE);
    let idle_cores = (cpu_seconds(pid)? - cpu0) / IDLE.as_secs_f64();
    let gaps1 = scrape(&metrics)?;
    let opened_before = newest(&held_lines)?["sessions"].as_u64().unwrap_or(0);

    // The flood, and meanwhile /healthz asked every 200 ms and a good agent started a third of
    // the way in.
    let mut flooder = Proc::spawn(
        Command::new(tools.join("fleet-loadgen"))
            .args(["--flood", "--rate", &flood.rate.to_string()])
            .args(["--sources", &flood.sources.to_string()])
            .args(["--duration", &format!("{}s", flood.seconds)])
            .arg("--join-files")
            .arg(&holds)
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(work.join("flood.log"))?),
    )?;
    // A host that tracks connections drops new ones once its table is full: start with room.
    let tracked = wait_for_conntrack_room()?;
    let dropped0 = conntrack_drops();
    let (cpu_start, began, overflows0) = (cpu_seconds(pid)?, Instant::now(), listen_overflows()?);
    let flood_lines = json_lines(&mut flooder, &work.join("flood.jsonl"))?;
    let mut healthz_ms = Vec::new();
    let mut flood_join = None;
    let mut good_agent = None;
    let join_at = Duration::from_secs(flood.seconds / 3);
    let mut last = Value::Null;
    // The flood's own CPU, read while it runs (once it has exited and is reaped, it is gone).
    let mut flooder_cpu = (0.0, 0.0);
    loop {
        if let Ok(cpu) = cpu_seconds(flooder.0.id()) {
            flooder_cpu = (cpu, began.elapsed().as_secs_f64());
        }
        if let Ok(Some(_)) = flooder.0.try_wait() {
            break;
        }
        if began.elapsed() > Duration::from_secs(flood.seconds + 30) {
            bail!("the flood did not end within 30 s of its duration");
        }
        while let Ok(line) = flood_lines.try_recv() {
            last = line;
        }
        if good_agent.is_none() && began.elapsed() >= join_at {
            let (agent, events) = agent(&coord, tools, &work.join("agent-flood"))?;
            good_agent = Some(agent);
            flood_join = Some(events);
        }
        let asked = began.elapsed().as_secs_f64();
        healthz_ms.push((asked, request_ms(&metrics, "/healthz")?));
        std::thread::sleep(Duration::from_millis(200));
    }
    let flood_s = began.elapsed().as_secs_f64();
    let overflows = listen_overflows()?.saturating_sub(overflows0);
    let conntrack_dropped = conntrack_drops()
        .zip(dropped0)
        .map(|(b, a)| b.saturating_sub(a));
    let conntrack = tracked.map(|(count, max)| (count, max, conntrack().map_or(0, |c| c.0)));
    let flood_cores = (cpu_seconds(pid)? - cpu_start) / flood_s;
    let flooder_cores = flooder_cpu.0 / flooder_cpu.1.max(1.0);
    while let Ok(line) = flood_lines.recv_timeout(Duration::from_millis(500)) {
        last = line;
    }
    let flood_join = match flood_join {
        Some(events) => timed_join(&events)?,
        None => bail!("the flood ended before the good agent was started"),
    };
    let gaps2 = scrape(&metrics)?;
    let held_now = newest(&held_lines)?;
    let peak_rss_mib = proc_status_kib(pid, "VmHWM")? as f64 / 1024.0;
    let agent_lost = quiet_events
        .try_iter()
        .filter(|(_, l)| l.contains("session lost"))
        .count();
    let text = std::fs::read_to_string(&log)?;
    let figures = Figures {
        idle_cores,
        flood_cores,
        flood_s,
        flooder_cores,
        counts: last,
        served_failed_joins: text
            .matches("a join with an unknown, expired or already spent token")
            .count(),
        refusing_lines: text.matches("refusing connections from").count(),
        idle_gaps: Gaps::between(&gaps0, &gaps1),
        flood_gaps: Gaps::between(&gaps1, &gaps2),
        held_live: held_now["live"].as_u64().unwrap_or(0),
        held_opened: held_now["sessions"]
            .as_u64()
            .unwrap_or(0)
            .saturating_sub(opened_before),
        agent_lost,
        idle_join,
        flood_join,
        overflows,
        conntrack,
        conntrack_dropped,
        healthz_ms,
        peak_rss_mib,
    };
    for mut proc in [flooder, held] {
        proc.stop();
    }
    quiet_agent.stop();
    if let Some(mut agent) = good_agent {
        agent.stop();
    }
    coord.stop();
    Ok(figures)
}

/// A real agent with a fresh token, started now; its log lines come with the moment they came.
fn agent(
    coord: &Coordinator,
    tools: &Path,
    machine: &Path,
) -> Result<(Proc, mpsc::Receiver<(Instant, String)>)> {
    std::fs::create_dir_all(machine)?;
    let join = machine.join("fleet.json");
    std::fs::write(&join, coord.cli(&["token", "--ttl", "1h"])?)?;
    let started = Instant::now();
    let mut proc = Proc::spawn(
        fleet::agent(&tools.join("fleet-agent"), &join, machine)
            .stdout(Stdio::null())
            .stderr(Stdio::piped()),
    )?;
    let stderr = proc.0.stderr.take().context("piped")?;
    let mut file = std::fs::File::create(machine.join("agent.log"))?;
    let (tx, rx) = mpsc::channel();
    let _ = tx.send((started, "started".to_string()));
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = writeln!(file, "{line}");
            let _ = tx.send((Instant::now(), line));
        }
    });
    Ok((proc, rx))
}

/// Reads an agent's lines until its session is open: its start to `Joined` and to the session.
fn timed_join(events: &mpsc::Receiver<(Instant, String)>) -> Result<Join> {
    let (started, _) = events.recv()?;
    let mut join = Join::default();
    loop {
        let (at, line) = events
            .recv_timeout(Duration::from_secs(60))
            .context("the agent neither joined nor opened its session within 60 s")?;
        let ms = at.duration_since(started).as_secs_f64() * 1000.0;
        if line.contains(" Joined") {
            join.joined_ms = ms;
            join.agent_ms = (line.split("elapsed_ms=").nth(1))
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|n| n.parse().ok())
                .unwrap_or(0);
        }
        if line.contains("session open") {
            join.session_ms = ms;
            return Ok(join);
        }
    }
}

/// A child's stdout as parsed JSON lines, as they come, each kept in `copy` too.
fn json_lines(proc: &mut Proc, copy: &Path) -> Result<mpsc::Receiver<Value>> {
    let stdout = proc.0.stdout.take().expect("piped");
    let mut copy = std::fs::File::create(copy)?;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = writeln!(copy, "{line}");
            if let Ok(v) = serde_json::from_str(&line)
                && tx.send(v).is_err()
            {
                return;
            }
        }
    });
    Ok(rx)
}

/// The newest line (they come once a second).
fn newest(lines: &mpsc::Receiver<Value>) -> Result<Value> {
    let mut newest = lines
        .recv_timeout(Duration::from_secs(5))
        .context("no counters from fleet-loadgen (see target/bench-flood/*/held.log)")?;
    while let Ok(v) = lines.try_recv() {
        newest = v;
    }
    Ok(newest)
}

/// The heartbeat-gap histogram now: (upper bound, cumulative count) per bucket, +Inf last, and
/// the sum of the gaps.
#[derive(Default)]
struct Histogram {
    buckets: Vec<(f64, u64)>,
    sum: f64,
}

fn scrape(metrics: &str) -> Result<Histogram> {
    let (_, text) = get(metrics, "/metrics")?;
    let mut histogram = Histogram::default();
    for line in text.lines() {
        let Some((name, value)) = line.rsplit_once(' ') else {
            continue;
        };
        if let Some(le) = name
            .strip_prefix(&format!("{GAPS}_bucket{{le=\""))
            .and_then(|rest| rest.strip_suffix("\"}"))
        {
            let bound = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse()?
            };
            histogram
                .buckets
                .push((bound, value.parse::<f64>()? as u64));
        } else if name == format!("{GAPS}_sum") {
            histogram.sum = value.parse()?;
        }
    }
    if histogram.buckets.is_empty() {
        bail!("the coordinator's /metrics has no {GAPS} histogram");
    }
    Ok(histogram)
}

/// The heartbeat gaps heard between two scrapes.
struct Gaps {
    count: u64,
    /// Gaps longer than two heartbeat periods: a heartbeat late by more than one interval.
    late: u64,
    mean_s: f64,
    /// The bucket bound at or under which 99% of the gaps, and all of them, fell.
    p99_at_most: f64,
    max_at_most: f64,
}

impl Gaps {
    fn between(before: &Histogram, after: &Histogram) -> Gaps {
        let deltas: Vec<(f64, u64)> = (after.buckets.iter())
            .map(|(le, n)| {
                let was = (before.buckets.iter())
                    .find(|(l, _)| l == le)
                    .map_or(0, |(_, n)| *n);
                (*le, n.saturating_sub(was))
            })
            .collect();
        let count = deltas.last().map_or(0, |(_, n)| *n);
        let on_time = (deltas.iter())
            .filter(|(le, _)| *le <= 2.0 * HEARTBEAT_S)
            .map(|(_, n)| *n)
            .max()
            .unwrap_or(0);
        let at_most = |share: f64| {
            (deltas.iter())
                .find(|(_, n)| *n as f64 >= share * count as f64)
                .map_or(f64::INFINITY, |(le, _)| *le)
        };
        Gaps {
            count,
            late: count - on_time,
            mean_s: (after.sum - before.sum) / count.max(1) as f64,
            p99_at_most: at_most(0.99),
            max_at_most: at_most(1.0),
        }
    }

    fn cell(&self) -> String {
        format!(
            "{} gaps, mean {:.3} s, p99 <= {} s, max <= {} s, {} late",
            self.count, self.mean_s, self.p99_at_most, self.max_at_most, self.late
        )
    }
}

/// The `q` quantile of some samples.
fn quantile(samples: &[f64], q: f64) -> f64 {
    let mut v = samples.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n => v[((n as f64 * q).ceil() as usize).clamp(1, n) - 1],
    }
}

fn report(flood: &FloodArgs, baseline: Option<&str>, columns: &[(String, Figures)]) -> String {
    let FloodArgs {
        rate,
        sources,
        seconds,
    } = flood;
    let baseline_flag = baseline.map_or(String::new(), |r| format!(" --baseline {r}"));
    let markdown = format!(
        "## flood: {rate} joins a second with wrong tokens from {sources} addresses\n\n\
         `cargo xtask bench flood --rate {rate} --sources {sources} --seconds {seconds}{baseline_flag}`: \
         `fleet-coordinator serve` (release build, glibc, embedded redb store, heartbeat {HEARTBEAT}, lease 10 s) \
         holding {SESSIONS} sessions of simulated nodes (`fleet-loadgen`, the real protocol) and one real agent, \
         then {seconds} s of `fleet-loadgen --flood`: {rate} connections a second from {sources} source addresses \
         (127.0.1.1 up, loopback), each the pinned TLS handshake with one throwaway key and a join with a token \
         never minted (a connection first waits 20 ms for the coordinator to close it, so one closed at accept \
         costs the flood no TLS work). A third of the way in, a real agent with a good token starts and joins \
         from 127.0.0.1. The coordinator's CPU is utime+stime from /proc over the window; heartbeat gaps are \
         the coordinator's own `{GAPS}` histogram (buckets 0.5, 1, 2, 4 s...) between scrapes, so a gap is \
         known to its bucket; \"late\" is a gap over two periods (late by more than one interval). \
         One run, on one machine of 2 cores shared by the coordinator, the flood, the simulated nodes and \
         the agents (and whatever else ran on it). The flood waits for the host's connection \
         tracking (nf_conntrack) to be at most a quarter full before it starts; its flood connections \
         end with a reset, so each leaves a tracking entry for 10 s, not the 2 minutes of TIME_WAIT.\n\n"
    );
    let mut table = Table::new(columns, "figure", "target (issue 26)");
    let n = |f: &Figures, k: &str| f.counts[k].as_u64().unwrap_or(0);
    table.row(
        "coordinator CPU, idle / during the flood",
        |f| {
            format!(
                "{:.3} / {:.2} cores ({:.0}% of one)",
                f.idle_cores,
                f.flood_cores,
                f.flood_cores * 100.0
            )
        },
        "under one core",
    );
    table.row(
        "connections made (over the flood's window) / due but not made (4 096 already open)",
        |f| {
            format!(
                "{} ({:.0}/s over {:.1} s) / {}",
                n(f, "attempts"),
                n(f, "attempts") as f64 / f.flood_s,
                f.flood_s,
                n(f, "skipped")
            )
        },
        "",
    );
    table.row(
        "refused at accept / closed after the join / joined / errors (of them, connects)",
        |f| {
            format!(
                "{} / {} / {} / {} ({})",
                n(f, "refused_at_accept"),
                n(f, "closed_after_join"),
                n(f, "joined"),
                n(f, "errors"),
                n(f, "connect_errors")
            )
        },
        "no join",
    );
    table.row(
        "failed joins the coordinator served (its log) / its refusing lines",
        |f| format!("{} / {}", f.served_failed_joins, f.refusing_lines),
        &format!("<= 10 + 1/s a source: {}", *sources as u64 * (10 + seconds)),
    );
    table.row(
        "held sessions' heartbeat gaps, idle 10 s",
        |f| f.idle_gaps.cell(),
        "",
    );
    table.row(
        "held sessions' heartbeat gaps, during the flood",
        |f| f.flood_gaps.cell(),
        "none late by more than one interval",
    );
    table.row(
        "held sessions at the end / opened again during the flood / the real agent's sessions lost",
        |f| format!("{} / {} / {}", f.held_live, f.held_opened, f.agent_lost),
        &format!("{SESSIONS} / 0 / 0"),
    );
    table.row(
        "a good token's agent, idle: start to `Joined` (its own count) / to its session open",
        |f| {
            format!(
                "{:.0} ms ({} ms) / {:.0} ms",
                f.idle_join.joined_ms, f.idle_join.agent_ms, f.idle_join.session_ms
            )
        },
        "",
    );
    table.row(
        "a good token's agent, during the flood: start to `Joined` (its own count) / to its session open",
        |f| {
            format!(
                "{:.0} ms ({} ms) / {:.0} ms",
                f.flood_join.joined_ms, f.flood_join.agent_ms, f.flood_join.session_ms
            )
        },
        "under 1 s",
    );
    table.row(
        "GET /healthz every 200 ms during the flood: median / p99 / max (asked at)",
        |f| {
            let times: Vec<f64> = f.healthz_ms.iter().map(|(_, ms)| *ms).collect();
            let (at, max) = (f.healthz_ms.iter().copied())
                .max_by(|a, b| a.1.total_cmp(&b.1))
                .unwrap_or_default();
            format!(
                "{:.1} / {:.1} / {max:.1} ms ({at:.1} s in)",
                median(&times),
                quantile(&times, 0.99),
            )
        },
        "",
    );
    table.row(
        "connections dropped by the kernel, the listen queue full (`ListenOverflows`, the whole machine)",
        |f| f.overflows.to_string(),
        "",
    );
    table.row(
        "the host's connection tracking: entries at the start / at the end (of at most) / packets dropped, its table full",
        |f| match (f.conntrack, f.conntrack_dropped) {
            (Some((start, max, end)), dropped) => format!(
                "{start} / {end} (of {max}) / {}",
                dropped.map_or("?".into(), |d| d.to_string())
            ),
            _ => "none on this host".into(),
        },
        "0 dropped",
    );
    table.row(
        "the flood process's own CPU",
        |f| format!("{:.2} cores", f.flooder_cores),
        "",
    );
    table.row(
        "coordinator peak RSS",
        |f| format!("{:.1} MiB", f.peak_rss_mib),
        "",
    );
    markdown + &table.markdown
}

/// The host's connection tracking table now: (entries, at most), when it has one.
fn conntrack() -> Option<(u64, u64)> {
    let read = |name: &str| -> Option<u64> {
        let path = format!("/proc/sys/net/netfilter/nf_conntrack_{name}");
        std::fs::read_to_string(path).ok()?.trim().parse().ok()
    };
    Some((read("count")?, read("max")?))
}

/// Packets the connection tracking dropped so far (every CPU), when the host has it.
fn conntrack_drops() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/net/stat/nf_conntrack").ok()?;
    let mut lines = text.lines();
    let column = lines.next()?.split_whitespace().position(|c| c == "drop")?;
    lines
        .map(|l| u64::from_str_radix(l.split_whitespace().nth(column)?, 16).ok())
        .sum()
}

/// Waits (up to 3 minutes, entries live 2 minutes after a close) until the host's connection
/// tracking table is at most a quarter full; returns what it holds then.
fn wait_for_conntrack_room() -> Result<Option<(u64, u64)>> {
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut said = false;
    loop {
        let Some((count, max)) = conntrack() else {
            return Ok(None);
        };
        if count <= max / 4 || Instant::now() > deadline {
            return Ok(Some((count, max)));
        }
        if !said {
            eprintln!("waiting for the host's connection tracking to empty: {count} of {max}");
            said = true;
        }
        std::thread::sleep(Duration::from_secs(2));
    }
}

/// The kernel's count of connections dropped because a listen queue was full (this network
/// namespace, every listener).
fn listen_overflows() -> Result<u64> {
    let text = std::fs::read_to_string("/proc/net/netstat")?;
    let mut tcp_ext = text.lines().filter(|l| l.starts_with("TcpExt:"));
    let (names, values) = (tcp_ext.next(), tcp_ext.next());
    let (Some(names), Some(values)) = (names, values) else {
        bail!("no TcpExt lines in /proc/net/netstat");
    };
    (names.split_whitespace().zip(values.split_whitespace()))
        .find(|(name, _)| *name == "ListenOverflows")
        .and_then(|(_, value)| value.parse().ok())
        .context("no ListenOverflows in /proc/net/netstat")
}

/// User plus system CPU seconds a process has used (all its threads).
fn cpu_seconds(pid: u32) -> Result<f64> {
    super::fleet::cpu_seconds(&[pid])
}
