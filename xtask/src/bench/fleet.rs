//! `cargo xtask bench fleet --nodes N --coordinators K --store redb|postgres`: K coordinators (on
//! their embedded store, K = 1, or on one PostgreSQL) and N simulated nodes (`fleet-loadgen`, the
//! real protocol: keys, pinned TLS, join, sessions, heartbeats, answers), one loadgen process per
//! coordinator, each holding the nodes whose join file names that coordinator first. Measures the
//! time for all to join, the coordinators' memory per live node, their CPU per heartbeat at a
//! steady 5 s heartbeat, the database's commits a second, one run dispatched to every node with
//! every result back (and the memory meanwhile), and with K > 1 the time for a SIGKILLed
//! coordinator's nodes to be back in session elsewhere. With `--baseline REV` the same fleet
//! runs again on REV's coordinator and load generator (`super::baseline`), side by side.
use super::baseline::Table;
use super::postgres::Cluster;
use crate::cross;
use crate::fleet::{self, Coordinator, Proc};
use crate::util::{proc_status_kib, record_benchmark};
use anyhow::{Context, Result, bail};
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub(super) const TARGET: &str = "x86_64-unknown-linux-musl";
pub(super) const HEARTBEAT: Duration = Duration::from_secs(5);
/// How long the steady heartbeat is watched for its CPU cost.
const STEADY: Duration = Duration::from_secs(30);

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum StoreKind {
    Redb,
    Postgres,
}

/// K coordinators serving, with `nodes` simulated nodes from one loadgen per coordinator.
pub(super) struct Bench {
    pub(super) coords: Vec<Coordinator>,
    loadgens: Vec<Proc>,
    counters: Vec<mpsc::Receiver<Value>>,
    pub(super) pids: Vec<u32>,
    cluster: Option<Cluster>,
    pub(super) work: PathBuf,
    /// The coordinators' RSS before any node joined.
    empty_kib: u64,
    /// Until every node was in session.
    join_s: f64,
    /// What each coordinator serves with, to start it again the same way.
    serve_flags: Vec<String>,
    release: PathBuf,
}

/// What the bench runs: the coordinator and the load generator.
const PACKAGES: &[&str] = &["fleet-coordinator", "fleet-loadgen"];

/// This tree's [`PACKAGES`], built static; returns their folder.
pub(super) fn release() -> Result<PathBuf> {
    cross::build_static(TARGET, PACKAGES)?;
    Ok(cross::target_dir().join(TARGET).join("release"))
}

impl Bench {
    /// Starts the fleet with the binaries of the folder `release`.
    pub(super) fn start(
        release: &Path,
        nodes: usize,
        k: usize,
        store: StoreKind,
        metrics: bool,
        loadgen_flags: &[&str],
    ) -> Result<Bench> {
        let release = release.to_path_buf();
        let work = fleet::fresh_dir("bench-fleet")?;
        let cluster = match store {
            StoreKind::Postgres => Some(Cluster::start(&work.join("pg"), 100 + 20 * k)?),
            StoreKind::Redb => None,
        };
        let heartbeat = format!("{}s", HEARTBEAT.as_secs());
        let mut flags = vec!["--heartbeat", &heartbeat, "--lease", "30s"];
        if !metrics {
            flags.extend(["--metrics-listen", "off"]);
        }
        let url = cluster.as_ref().map(Cluster::url);
        if let Some(url) = &url {
            flags.extend(["--store", url]);
        }
        let mut coords = Vec::new();
        for i in 0..k {
            let data = work.join(format!("coord-{i}"));
            if i > 0 {
                // The fleet's key, copied as an operator would.
                std::fs::create_dir_all(&data)?;
                let key = work.join("coord-0").join("coordinator.key");
                std::fs::copy(key, data.join("coordinator.key"))?;
            }
            let log = std::fs::File::create(work.join(format!("coord-{i}.log")))?;
            coords.push(Coordinator::serve(
                &release.join("fleet-coordinator"),
                &data,
                &flags,
                Stdio::from(log),
            )?);
        }
        let joins = join_files(&coords, nodes, &work)?;
        let pids: Vec<u32> = coords.iter().map(Coordinator::pid).collect();
        let empty_kib = rss_kib(&pids)?;

        let mut loadgens = Vec::new();
        let mut counters = Vec::new();
        for (i, join) in joins.iter().enumerate() {
            let mut loadgen = Proc::spawn(
                Command::new(release.join("fleet-loadgen"))
                    .arg("--join-files")
                    .arg(join)
                    .arg("--duration")
                    .arg("1h")
                    .arg("--blobs")
                    .arg(work.join(format!("loadgen-{i}-blobs")))
                    .args(loadgen_flags)
                    .stdout(Stdio::piped())
                    .stderr(std::fs::File::create(
                        work.join(format!("loadgen-{i}.log")),
                    )?),
            )?;
            counters.push(counter_lines(&mut loadgen));
            loadgens.push(loadgen);
        }
        let started = Instant::now();
        let all = nodes as u64;
        wait_until(
            &counters,
            900,
            |c| c["live"].as_u64().unwrap_or(0) >= all,
            "all nodes in session",
        )?;
        Ok(Bench {
            coords,
            loadgens,
            counters,
            pids,
            cluster,
            work,
            empty_kib,
            join_s: started.elapsed().as_secs_f64(),
            serve_flags: flags.iter().map(|f| f.to_string()).collect(),
            release,
        })
    }

    pub(super) fn rss_kib(&self) -> Result<u64> {
        rss_kib(&self.pids)
    }

    pub(super) fn counter(&self, name: &str) -> Result<u64> {
        Ok(sum(&latest(&self.counters)?, name))
    }

    /// Runs `sets` (one `run --all` each) of a program that exits 0, and waits until the
    /// loadgens finished `runs` of them and every row of every set is final; answers the time
    /// from the first submit and the coordinators' peak RSS meanwhile.
    fn dispatch(&self, sets: usize, runs: u64) -> Result<(f64, u64)> {
        let program = self.work.join("true.sh");
        std::fs::write(&program, "#!/bin/sh\nexit 0\n")?;
        let started = Instant::now();
        let mut peak_kib = self.rss_kib()?;
        let mut ids = Vec::new();
        for _ in 0..sets {
            ids.push(self.coords[0].run_set(&program, &[])?);
            peak_kib = peak_kib.max(self.rss_kib()?);
        }
        let mut finals = 0;
        loop {
            peak_kib = peak_kib.max(self.rss_kib()?);
            if self.counter("finished")? >= runs {
                // Once the nodes reported every end, the rows are read (each set once, as each
                // read of thousands of rows costs the coordinator a little).
                while finals < ids.len() {
                    let rows: Vec<Value> = serde_json::from_str(&self.coords[0].cli(&[
                        "status",
                        "--set",
                        &ids[finals],
                        "--json",
                    ])?)?;
                    if !rows.iter().all(|r| r["state"] == "finished") {
                        break;
                    }
                    finals += 1;
                }
                if finals == ids.len() {
                    break;
                }
            }
            if started.elapsed() > Duration::from_secs(900) {
                bail!("the {runs} runs did not all finish within 15 minutes");
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Ok((started.elapsed().as_secs_f64(), peak_kib))
    }

    /// SIGTERMs coordinator `i` and starts it again on the same address, data and flags;
    /// returns how long it took to exit and how long the new one took to listen.
    fn restart(&mut self, i: usize) -> Result<(Duration, Duration)> {
        let signalled = Instant::now();
        self.coords[i].terminate()?;
        let exited = Instant::now();
        let log = std::fs::OpenOptions::new()
            .append(true)
            .open(self.work.join(format!("coord-{i}.log")))?;
        let flags: Vec<&str> = self.serve_flags.iter().map(String::as_str).collect();
        let addr = self.coords[i].addr.clone();
        self.coords[i] = Coordinator::serve_at(
            &self.release.join("fleet-coordinator"),
            &self.work.join(format!("coord-{i}")),
            &addr,
            &flags,
            Stdio::from(log),
        )?;
        self.pids[i] = self.coords[i].pid();
        Ok((exited - signalled, exited.elapsed()))
    }

    pub(super) fn stop(self) {
        for mut loadgen in self.loadgens {
            loadgen.stop();
        }
        for mut coord in self.coords {
            coord.stop();
        }
    }
}

/// `bench fleet`: with `baseline`, the same fleet again on the binaries of that commit (its
/// coordinator with its own load generator: they speak its protocol), right after this tree's.
pub fn run(
    nodes: usize,
    coordinators: usize,
    store: StoreKind,
    metrics: bool,
    baseline: Option<&str>,
) -> Result<()> {
    if coordinators > 1 && store == StoreKind::Redb {
        bail!("several coordinators share a fleet only on PostgreSQL: pass --store postgres");
    }
    let k = coordinators.max(1);
    let sides = super::baseline::sides(release()?, baseline, Some(TARGET), PACKAGES)?;
    let mut columns = Vec::new();
    for (name, release) in sides {
        columns.push((name, measure(&release, nodes, k, store, metrics)?));
    }
    if columns.len() == 1 {
        // Alone, as before: the one column is the value.
        columns[0].0 = "value".to_string();
    }
    let markdown = report(nodes, k, store, metrics, baseline, &columns);
    println!("{markdown}");
    record_benchmark(
        &format!(
            "fleet-{store_arg}-{k}-{nodes}{off}",
            store_arg = format!("{store:?}").to_lowercase(),
            off = if metrics { "" } else { "-no-metrics" },
        ),
        &markdown,
    )
}

/// What one fleet of [`run`] measured.
struct Figures {
    join_s: f64,
    /// The coordinators' RSS with no node, with every node idle, and at most while dispatching.
    empty_kib: u64,
    idle_kib: u64,
    peak_kib: u64,
    cpu_us_per_beat: f64,
    beats: u64,
    core_share: f64,
    commits_per_s: Option<f64>,
    diagnostics: Option<Diagnostics>,
    dispatch_s: f64,
    fetched: u64,
    fetch_failures: u64,
    failover: Option<String>,
}

fn measure(
    release: &Path,
    nodes: usize,
    k: usize,
    store: StoreKind,
    metrics: bool,
) -> Result<Figures> {
    let mut bench = Bench::start(release, nodes, k, store, metrics, &[])?;
    let (empty_kib, join_s) = (bench.empty_kib, bench.join_s);
    let all = nodes as u64;
    let count = |c: &Value, name: &str| c[name].as_u64().unwrap_or(0);

    // Steady state: every node heartbeating; memory and CPU of the coordinators alone.
    std::thread::sleep(HEARTBEAT * 2);
    let idle_kib = bench.rss_kib()?;
    let commits = |c: &Option<Cluster>| c.as_ref().map(Cluster::commits).transpose();
    let (cpu0, beats0, commits0) = (
        cpu_seconds(&bench.pids)?,
        bench.counter("heartbeats")?,
        commits(&bench.cluster)?,
    );
    std::thread::sleep(STEADY);
    let (cpu1, beats1, commits1) = (
        cpu_seconds(&bench.pids)?,
        bench.counter("heartbeats")?,
        commits(&bench.cluster)?,
    );
    let beats = beats1.saturating_sub(beats0).max(1);
    let cpu_us_per_beat = (cpu1 - cpu0) * 1e6 / beats as f64;
    let core_share = (cpu1 - cpu0) / STEADY.as_secs_f64() * 100.0;
    let commits_per_s = commits0
        .zip(commits1)
        .map(|(a, b)| b.saturating_sub(a) as f64 / STEADY.as_secs_f64() / k as f64);

    // What an operator's tools cost with every session held: a scrape and the first nodes page.
    // The first scrape reads the store; from then on the background loop keeps a census every
    // heartbeat period, which the scrapes that follow read.
    let diagnostics = match metrics {
        true => Some(time_diagnostics(&bench.work.join("coord-0.log"))?),
        false => None,
    };

    // One run to every node, through the first coordinator, until every row is final: each
    // node fetches the program on the agent's content path first.
    let (dispatch_s, peak_kib) = bench.dispatch(1, all)?;
    let peak_kib = peak_kib.max(idle_kib);
    let (fetched, fetch_failures) = (bench.counter("fetched")?, bench.counter("fetch_failures")?);

    // With several coordinators: one SIGKILLed, its nodes back in session at the others.
    let failover = if k > 1 {
        let before = bench.counter("sessions")?;
        let killed = Instant::now();
        bench.coords[0].stop();
        let held = all / k as u64;
        let back = |c: &Value| count(c, "sessions") >= before + held && count(c, "live") >= all;
        // The others may not have room for them all (each process may hold 20 000 open files):
        // then how many came back within two minutes is the figure.
        match wait_until(
            &bench.counters,
            120,
            back,
            "the killed coordinator's nodes back",
        ) {
            Ok(()) => Some(format!("{:.1} s", killed.elapsed().as_secs_f64())),
            Err(_) => {
                let live = bench.counter("live")?;
                Some(format!(
                    "{} of {held} back within 120 s, {live} of {all} in session: the other coordinators reached their open-file limit",
                    live.saturating_sub(all - held)
                ))
            }
        }
    } else {
        None
    };
    bench.stop();
    Ok(Figures {
        join_s,
        empty_kib,
        idle_kib,
        peak_kib,
        cpu_us_per_beat,
        beats,
        core_share,
        commits_per_s,
        diagnostics,
        dispatch_s,
        fetched,
        fetch_failures,
        failover,
    })
}

fn report(
    nodes: usize,
    k: usize,
    store: StoreKind,
    metrics: bool,
    baseline: Option<&str>,
    columns: &[(String, Figures)],
) -> String {
    let store_name = match store {
        StoreKind::Redb => "embedded redb store",
        StoreKind::Postgres => {
            "one PostgreSQL 15 (Debian's, default settings but `max_pred_locks_per_transaction = 4096` as `serve` advises, fsync on)"
        }
    };
    let hb = HEARTBEAT.as_secs();
    let markdown = format!(
        "## fleet: {k} coordinator(s), {store:?}, {nodes} nodes{title_off}\n\n\
         `cargo xtask bench fleet --nodes {nodes} --coordinators {k} --store {store_arg}{off_flag}{baseline_flag}`: {k} \
         `fleet-coordinator serve` (static `{TARGET}` release, {store_name}, heartbeat {hb} s, {listener}) and \
         {nodes} simulated nodes from `fleet-loadgen` ({k} process(es), one per coordinator) on \
         loopback, each with its own Ed25519 key, the pinned TLS join, a session with facts and \
         heartbeats, a fetch of each program on the agent's own content path (pinned TLS, hashed \
         as it lands, once per node), and answers to starts (reported `running` and `finished` \
         without running anything). One run of each figure, on one machine of 2 cores shared by \
         every process{sides}.\n\n",
        store_arg = match store {
            StoreKind::Redb => "redb",
            StoreKind::Postgres => "postgres",
        },
        off_flag = if metrics { "" } else { " --no-metrics" },
        baseline_flag = baseline.map_or(String::new(), |r| format!(" --baseline {r}")),
        title_off = if metrics {
            ""
        } else {
            ", metrics listener off"
        },
        listener = if metrics {
            "metrics listener on a loopback port"
        } else {
            "metrics listener off"
        },
        sides = if baseline.is_some() {
            "; this tree's fleet first, then the baseline's (its coordinator with its own \
             `fleet-loadgen`), one right after the other"
        } else {
            ""
        },
    );
    let mib = |kib: u64| kib as f64 / 1024.0;
    let mut table = Table::new(columns, "figure", "target (issue 14)");
    table.row(
        &format!("all {nodes} nodes joined and in session"),
        |f| format!("{:.1} s", f.join_s),
        "",
    );
    table.row(
        &format!("coordinators' RSS, no node / {nodes} idle nodes"),
        |f| format!("{:.1} MiB / {:.1} MiB", mib(f.empty_kib), mib(f.idle_kib)),
        "",
    );
    table.row(
        "coordinator RSS per live node",
        |f| {
            let per_node = f.idle_kib.saturating_sub(f.empty_kib) as f64 / nodes as f64;
            format!("{per_node:.1} KiB")
        },
        "<= 32 KiB",
    );
    table.row(
        &format!(
            "coordinator CPU per heartbeat (over {} s)",
            STEADY.as_secs()
        ),
        |f| format!("{:.0} µs ({} heartbeats)", f.cpu_us_per_beat, f.beats),
        "<= 50 µs",
    );
    table.row(
        &format!("coordinators' CPU at a steady {hb} s heartbeat"),
        |f| format!("{:.0}% of one core", f.core_share),
        "",
    );
    table.row(
        "one run to each node, dispatched, its program fetched (fetches, failed) and every result back",
        |f| format!("{:.1} s ({} fetches, {} failed)", f.dispatch_s, f.fetched, f.fetch_failures),
        "< 30 s for 10 000 (redb), < 60 s (PostgreSQL), no fetch failing",
    );
    table.row(
        "coordinators' peak RSS while dispatching / idle",
        |f| {
            let ratio = f.peak_kib as f64 / f.idle_kib.max(1) as f64;
            format!("{:.1} MiB ({ratio:.2}x)", mib(f.peak_kib))
        },
        "<= 2x",
    );
    let first = &columns[0].1;
    if first.diagnostics.is_some() {
        let ms = |f: &Figures, pick: fn(&Diagnostics) -> f64| {
            f.diagnostics
                .as_ref()
                .map_or(String::new(), |d| format!("{:.1} ms", pick(d)))
        };
        table.row(
            "the first scrape of `/metrics` with every session held (from the census when this coordinator sweeps, else from the store; on loopback, request to last byte)",
            |f| ms(f, |d| d.cold_scrape_ms),
            "",
        );
        table.row(
            &format!("a scrape of `/metrics` with every session held, once scrapes come (median of {REQUESTS}, the same way)"),
            |f| ms(f, |d| d.scrape_ms),
            "< 50 ms",
        );
        table.row(
            &format!("the first page of `/nodes` rendered with every session held (median of {REQUESTS}, the same way)"),
            |f| ms(f, |d| d.page_ms),
            "< 200 ms",
        );
    }
    if first.commits_per_s.is_some() {
        table.row(
            "database commits a second per coordinator at the steady heartbeat (every transaction, reads included)",
            |f| f.commits_per_s.map_or(String::new(), |r| format!("{r:.1}")),
            "<= 10",
        );
    }
    if first.failover.is_some() {
        table.row(
            "one coordinator SIGKILLed: its nodes back in session at the others",
            |f| f.failover.clone().unwrap_or_default(),
            "within 2 heartbeats of their backoff",
        );
    }
    markdown + &table.markdown
}

/// The TCP connections established to the listener at `addr` (`host:port`): its sessions,
/// and the few peer and operator connections of the moment.
fn established(addr: &str) -> Result<u64> {
    let port = addr.rsplit(':').next().unwrap_or_default();
    let out = Command::new("ss")
        .args([
            "-Htn",
            "state",
            "established",
            &format!("( sport = :{port} )"),
        ])
        .output()
        .context("cannot run ss")?;
    if !out.status.success() {
        bail!("ss failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(out
        .stdout
        .split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .count() as u64)
}

/// `bench fleet --rolling-restart`: every coordinator of the fleet restarted in turn (SIGTERM,
/// started again on its address) while a run to every node is dispatched through the others;
/// per restart, how long until every node holds a session again and how many runs ended
/// meanwhile; then every row final, each run started once, and each coordinator's peak RSS
/// against its idle.
pub fn rolling_restart(nodes: usize, coordinators: usize) -> Result<()> {
    if coordinators < 2 {
        bail!("a rolling restart needs two coordinators or more: pass --coordinators 3");
    }
    let k = coordinators;
    let mut bench = Bench::start(&release()?, nodes, k, StoreKind::Postgres, false, &[])?;
    std::thread::sleep(HEARTBEAT * 2);
    let idle: Vec<u64> = (bench.pids.iter())
        .map(|&pid| proc_status_kib(pid, "VmRSS"))
        .collect::<Result<_>>()?;
    // The peaks count from here: the nodes' joins before idle are not part of a restart.
    for pid in &bench.pids {
        std::fs::write(format!("/proc/{pid}/clear_refs"), "5")
            .with_context(|| format!("cannot reset the peak RSS of coordinator pid {pid}"))?;
    }
    let mut peak = idle.clone();
    let all = nodes as u64;
    let (mut rows, mut sets, mut slowest) = (Vec::new(), Vec::new(), 0.0f64);
    for i in 0..k {
        // A run to every node through the next coordinator, then this one restarted. A program
        // of its own each time: on PostgreSQL, recording a set of 30 000 rows of the program
        // whose runs are ending meanwhile meets their changes to its reference count, and does
        // not commit (a limit written down in BENCHMARKS.md).
        let program = bench.work.join(format!("true-{i}.sh"));
        std::fs::write(&program, format!("#!/bin/sh\n# set {i}\nexit 0\n"))?;
        let via = (i + 1) % k;
        sets.push((via, bench.coords[via].run_set(&program, &[])?));
        let (finished0, started) = (bench.counter("finished")?, Instant::now());
        // The stopping process's peak, before it is gone.
        note_peaks(&bench.pids, &mut peak);
        let (exit, listen) = bench.restart(i)?;
        // The loadgens' counters come once a second: the next ones show the sessions it held
        // gone, and then back.
        std::thread::sleep(Duration::from_millis(1500));
        let back = loop {
            note_peaks(&bench.pids, &mut peak);
            if bench.counter("live")? >= all {
                break started.elapsed().as_secs_f64();
            }
            if started.elapsed() > Duration::from_secs(600) {
                bail!("the nodes were not all back in session within 10 minutes of restart {i}");
            }
        };
        // Then the nodes it held come home (each dials home every 15 to 45 s), so the next restart
        // begins from a balanced fleet, as an operator's would: each coordinator holds its share
        // of the sessions again.
        let share = all / k as u64;
        let balanced = loop {
            note_peaks(&bench.pids, &mut peak);
            let held = (bench.coords.iter())
                .map(|c| established(&c.addr))
                .collect::<Result<Vec<u64>>>()?;
            if held.iter().all(|&h| h >= share * 97 / 100) {
                break started.elapsed().as_secs_f64();
            }
            if started.elapsed() > Duration::from_secs(600) {
                bail!(
                    "the sessions were not balanced again within 10 minutes of restart {i}: {held:?}"
                );
            }
            std::thread::sleep(Duration::from_millis(500));
        };
        let ended = bench.counter("finished")? - finished0;
        slowest = slowest.max(back);
        let row = format!(
            "| coord-{i} restarted (SIGTERM, started again) | {:.1} s / {:.1} s | {back:.1} s | {balanced:.1} s | {ended} |",
            exit.as_secs_f64(),
            listen.as_secs_f64()
        );
        // As it is measured: a run stopped later still shows its restarts.
        eprintln!("{row}");
        rows.push(row);
    }
    let runs = all * k as u64;
    let started = Instant::now();
    let (mut finals, mut looked) = (0, Instant::now());
    while finals < sets.len() {
        note_peaks(&bench.pids, &mut peak);
        // The rows are read once the nodes' counters say every run ended, and every 15 s before
        // that to stop at a lost or failed one: a set of 30 000 rows read twice a second cost
        // PostgreSQL and the coordinator as much as the dispatch it waited for (run 33).
        if started.elapsed() > Duration::from_secs(600) {
            bail!("the runs were not all final within 10 minutes of the last restart");
        }
        let ended = bench.counter("finished")? >= runs;
        if !ended && looked.elapsed() < Duration::from_secs(15) {
            continue;
        }
        looked = Instant::now();
        let (via, set) = &sets[finals];
        let states: Vec<Value> =
            serde_json::from_str(&bench.coords[*via].cli(&["status", "--set", set, "--json"])?)?;
        if states.iter().all(|r| r["state"] == "finished") {
            finals += 1;
            continue;
        }
        if let Some(r) = states
            .iter()
            .find(|r| r["state"] == "lost" || r["state"] == "failed")
        {
            bail!("a run ended {}: {r}", r["state"]);
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    let starts = bench.counter("starts")?;
    note_peaks(&bench.pids, &mut peak);
    bench.stop();
    let worst = (0..k)
        .map(|i| peak[i] as f64 / idle[i].max(1) as f64)
        .fold(0.0, f64::max);
    let ratios: Vec<String> = (0..k)
        .map(|i| {
            format!(
                "coord-{i} {:.0} / {:.0} MiB",
                peak[i] as f64 / 1024.0,
                idle[i] as f64 / 1024.0
            )
        })
        .collect();
    let lease = 30;
    let markdown = format!(
        "## fleet: rolling restart of {k} coordinators, PostgreSQL, {nodes} nodes\n\n\
         `cargo xtask bench fleet --coordinators {k} --store postgres --nodes {nodes} --rolling-restart`: \
         {k} `fleet-coordinator serve` (static `{TARGET}` release allocating through jemalloc, one PostgreSQL 15 with `max_pred_locks_per_transaction = 4096`, heartbeat \
         {hb} s, lease {lease} s, metrics off) and {nodes} simulated nodes from `fleet-loadgen` \
         (one process per coordinator). Before each restart, a run to every node through the next \
         coordinator; then the coordinator is sent SIGTERM (it tells each session it stops, and \
         the node dials it again for 10 s before moving on, the first time after a random wait of up \
         to a quarter lease) and started again on its address, and \
         the next restart waits until the nodes it held are back home (each coordinator holding \
         97% of its share of the sessions, counted with `ss`). Idle is each coordinator's RSS \
         with every node in session before the first restart; its peak is the kernel's high-water \
         mark (`VmHWM`, reset at idle, and the restarted process's own from its start). One run, \
         on one machine of 2 cores shared by every process.\n\n\
         | restart | SIGTERM to exit / start to listening | every node in session again | each coordinator holding its share again | runs ended meanwhile |\n|---|---|---|---|---|\n{}\n\n\
         | figure | value | target (issue 21) |\n|---|---|---|\n\
         | every node back after each restart | {slowest:.1} s at most | within two leases ({two} s) |\n\
         | runs: rows final / finished / started by the nodes | {runs} / {runs} / {starts} | none lost or doubled |\n\
         | peak RSS / idle per coordinator ({ratios}) | {worst:.2}x at most | <= 1.5x |\n",
        rows.join("\n"),
        hb = HEARTBEAT.as_secs(),
        two = 2 * lease,
        ratios = ratios.join(", "),
    );
    println!("{markdown}");
    record_benchmark(&format!("fleet-rolling-{k}-{nodes}"), &markdown)
}

/// Runs each node gets in the queue benchmark, and its capacity.
const QUEUED_PER_NODE: usize = 10;
const QUEUE_CAPACITY: u32 = 4;
/// How long a queued run "runs" on a simulated node before it reports its end.
const QUEUED_RUN_MS: u64 = 250;

/// `bench fleet --queue`: ten runs to every node of capacity four (one `run --all` ten times),
/// so most wait queued for capacity and start as slots free; the loadgen counts every start
/// beyond a node's capacity.
pub fn queue(nodes: usize, store: StoreKind) -> Result<()> {
    let capacity = QUEUE_CAPACITY.to_string();
    let run_ms = QUEUED_RUN_MS.to_string();
    let flags = ["--capacity", &capacity, "--run-ms", &run_ms];
    let bench = Bench::start(&release()?, nodes, 1, store, false, &flags)?;
    std::thread::sleep(HEARTBEAT * 2);
    let idle_kib = bench.rss_kib()?;
    let runs = (nodes * QUEUED_PER_NODE) as u64;
    let (final_s, peak_kib) = bench.dispatch(QUEUED_PER_NODE, runs)?;
    let peak_kib = peak_kib.max(idle_kib);
    let (starts, over, fetched, fetch_failures) = (
        bench.counter("starts")?,
        bench.counter("over_capacity")?,
        bench.counter("fetched")?,
        bench.counter("fetch_failures")?,
    );
    bench.stop();
    let (store_arg, target_s) = match store {
        StoreKind::Redb => ("redb", 60),
        StoreKind::Postgres => ("postgres", 120),
    };
    let markdown = format!(
        "## fleet queue: {store:?}, {runs} runs to {nodes} nodes of capacity {QUEUE_CAPACITY}\n\n\
         `cargo xtask bench fleet --queue --nodes {nodes} --store {store_arg}`: one \
         `fleet-coordinator serve` (static `{TARGET}` release, metrics listener off) and {nodes} \
         simulated nodes from `fleet-loadgen`, each declaring capacity {QUEUE_CAPACITY}, fetching \
         the program once on the agent's content path and reporting each run's end \
         {QUEUED_RUN_MS} ms after its start. `run --all` {QUEUED_PER_NODE} times: {runs} runs, \
         most of them queued for capacity. One run, on one machine of 2 cores shared by every \
         process.\n\n\
         | figure | value | target (issue 22) |\n\
         |---|---|---|\n\
         | every row final, from the first submit | {final_s:.1} s | < {target_s} s |\n\
         | runs started a second | {rate:.0} | |\n\
         | starts beyond a node's capacity (counted by the nodes) | {over} of {starts} | 0 |\n\
         | programs fetched / fetches failed | {fetched} / {fetch_failures} | {nodes} / 0 |\n\
         | coordinator's peak RSS / idle with every session held | {peak:.1} MiB / {idle:.1} MiB ({ratio:.2}x) | <= 2x |\n",
        rate = runs as f64 / final_s,
        peak = peak_kib as f64 / 1024.0,
        idle = idle_kib as f64 / 1024.0,
        ratio = peak_kib as f64 / idle_kib.max(1) as f64,
    );
    println!("{markdown}");
    record_benchmark(&format!("fleet-queue-{store_arg}-{nodes}"), &markdown)
}

/// What the diagnostic listener's requests took.
struct Diagnostics {
    cold_scrape_ms: f64,
    scrape_ms: f64,
    page_ms: f64,
}

/// The first scrape (it reads the store); then, once the background loop keeps a census every
/// heartbeat period, the scrapes that follow, and the first nodes page.
fn time_diagnostics(log: &Path) -> Result<Diagnostics> {
    let metrics = metrics_addr(log)?;
    let cold_scrape_ms = request_ms(&metrics, "/metrics")?;
    std::thread::sleep(HEARTBEAT + Duration::from_secs(1));
    Ok(Diagnostics {
        cold_scrape_ms,
        scrape_ms: median_request_ms(&metrics, "/metrics")?,
        page_ms: median_request_ms(&metrics, "/nodes")?,
    })
}

/// Requests timed for each of the diagnostic listener's figures.
const REQUESTS: usize = 20;

/// The metrics listener's `host:port`, from the coordinator's log line that names it.
pub(super) fn metrics_addr(log: &Path) -> Result<String> {
    let text = std::fs::read_to_string(log)?;
    (text.lines())
        .find_map(|l| l.split("serving metrics on http://").nth(1))
        .and_then(|rest| rest.split("/metrics").next())
        .map(str::to_string)
        .context("the coordinator logged no metrics address")
}

/// The median time of [`REQUESTS`] GETs of `path`.
fn median_request_ms(addr: &str, path: &str) -> Result<f64> {
    let mut times = (0..REQUESTS)
        .map(|_| request_ms(addr, path))
        .collect::<Result<Vec<f64>>>()?;
    times.sort_by(f64::total_cmp);
    Ok(times[REQUESTS / 2])
}

/// One GET of `path` on `addr`, from connecting to its answer's last byte, in ms; it must
/// answer 200.
pub(super) fn request_ms(addr: &str, path: &str) -> Result<f64> {
    Ok(get(addr, path)?.0)
}

/// One GET of `path` on `addr` (`connection: close`): the ms it took and the whole answer; it
/// must answer 200.
pub(super) fn get(addr: &str, path: &str) -> Result<(f64, String)> {
    use std::io::{Read, Write};
    let began = Instant::now();
    let mut stream = std::net::TcpStream::connect(addr)?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n"
    )?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer)?;
    let took = began.elapsed().as_secs_f64() * 1000.0;
    let answer = String::from_utf8_lossy(&answer).into_owned();
    if !answer.starts_with("HTTP/1.1 200") {
        bail!(
            "GET {path} was answered {:?}",
            answer.chars().take(80).collect::<String>()
        );
    }
    Ok((took, answer))
}

/// One JSON-lines file of join files per coordinator: `nodes` tokens minted once every
/// coordinator knows the others, node i naming coordinator i % K first and the rest after it in
/// an order that varies from node to node (as each agent shuffles them), so a killed
/// coordinator's nodes spread over the others.
fn join_files(
    coords: &[Coordinator],
    nodes: usize,
    work: &Path,
) -> Result<Vec<std::path::PathBuf>> {
    let k = coords.len();
    let deadline = Instant::now() + Duration::from_secs(60);
    let minted = loop {
        let minted = coords[0].cli(&["token", "--count", &nodes.to_string(), "--ttl", "1h"])?;
        let first: Value = serde_json::from_str(minted.lines().next().unwrap_or("{}"))?;
        if first["alternates"].as_array().map_or(0, Vec::len) + 1 >= k {
            break minted;
        }
        if Instant::now() > deadline {
            bail!("the coordinators did not all know each other within a minute");
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    let addresses: Vec<String> = coords.iter().map(|c| c.addr.clone()).collect();
    let mut per_coordinator = vec![String::new(); k];
    for (i, line) in minted.lines().enumerate() {
        let mut join: Value = serde_json::from_str(line)?;
        let first = i % k;
        let mut order = vec![&addresses[first]];
        let others: Vec<&String> = (1..k).map(|j| &addresses[(first + j) % k]).collect();
        let turn = (i / k) % others.len().max(1);
        order.extend(others[turn..].iter().chain(&others[..turn]).copied());
        join["address"] = Value::from(order[0].clone());
        join["alternates"] = Value::from(
            order[1..]
                .iter()
                .map(|a| Value::from(a.as_str()))
                .collect::<Vec<_>>(),
        );
        per_coordinator[i % k].push_str(&join.to_string());
        per_coordinator[i % k].push('\n');
    }
    let mut files = Vec::new();
    for (i, text) in per_coordinator.into_iter().enumerate() {
        let path = work.join(format!("joins-{i}.jsonl"));
        std::fs::write(&path, text)?;
        files.push(path);
    }
    Ok(files)
}

fn rss_kib(pids: &[u32]) -> Result<u64> {
    pids.iter().map(|&pid| proc_status_kib(pid, "VmRSS")).sum()
}

/// The loadgen's counter lines, parsed, as they arrive.
/// Raises each slot's peak to its process's high-water mark of resident memory (`VmHWM`, reset
/// at idle): the kernel's own peak, which samples of `VmRSS` between two reads would miss.
fn note_peaks(pids: &[u32], peak: &mut [u64]) {
    for (slot, &pid) in pids.iter().enumerate() {
        peak[slot] = peak[slot].max(proc_status_kib(pid, "VmHWM").unwrap_or(0));
    }
}

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

/// The newest counter line of each loadgen (they come once a second).
fn latest(lines: &[mpsc::Receiver<Value>]) -> Result<Vec<Value>> {
    lines
        .iter()
        .map(|rx| {
            let mut newest = rx.recv_timeout(Duration::from_secs(5)).context(
                "no counters from fleet-loadgen (it stopped: see target/bench-fleet/loadgen-*.log)",
            )?;
            while let Ok(v) = rx.try_recv() {
                newest = v;
            }
            Ok(newest)
        })
        .collect()
}

/// One counter summed over the loadgens.
fn sum(latest: &[Value], counter: &str) -> u64 {
    latest
        .iter()
        .map(|v| v[counter].as_u64().unwrap_or(0))
        .sum()
}

/// Waits until `check` passes on the counters summed over the loadgens, within `seconds`.
fn wait_until(
    lines: &[mpsc::Receiver<Value>],
    seconds: u64,
    check: impl Fn(&Value) -> bool,
    what: &str,
) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let names = [
        "joined",
        "sessions",
        "live",
        "heartbeats",
        "starts",
        "finished",
        "failures",
    ];
    loop {
        let newest = latest(lines)?;
        let total: serde_json::Map<String, Value> = names
            .iter()
            .map(|n| (n.to_string(), Value::from(sum(&newest, n))))
            .collect();
        let total = Value::Object(total);
        if check(&total) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{what}: not within {seconds} s; counters {total}");
        }
    }
}

/// User plus system CPU seconds the processes have used.
pub(super) fn cpu_seconds(pids: &[u32]) -> Result<f64> {
    let mut total = 0.0;
    for pid in pids {
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
        total += ticks / hz;
    }
    Ok(total)
}
