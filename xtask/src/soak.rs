//! `cargo xtask soak`: SIGKILL the agent at random moments across many runs; every run happens once.
//!
//! The same loop as the crash-loop test, longer: runs are submitted while the agent is killed and
//! restarted; at the end every run must have executed exactly once (each appends its own run
//! folder to a side-effect file) and reached the coordinator exactly once (no duplicate event).
use crate::fleet::{self, Coordinator, Proc};
use crate::util;
use anyhow::{Result, bail};
use std::collections::HashMap;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

/// Runs submitted per kill, in one set: several in flight when the agent dies.
const RUNS_PER_KILL: usize = 8;
/// Kills between two settles, where every run so far is waited for and its row read: fewer
/// runs than the coordinator keeps per node (its newest 1 000 final ones), so every row is
/// read before retention prunes it.
const KILLS_PER_SETTLE: usize = 100;

pub fn run(kills: usize) -> Result<()> {
    let bin = fleet::build_debug()?;
    let work = fleet::fresh_dir("soak")?;
    let serve = Coordinator::serve(
        &bin,
        &work.join("coordinator"),
        &["--heartbeat", "200ms", "--lease", "5s"],
        std::fs::File::create(work.join("coordinator.log"))?.into(),
    )?;
    let coordinator = |args: &[&str]| serve.cli(args);
    std::fs::write(work.join("fleet.json"), coordinator(&["token"])?)?;
    let effects = work.join("effects");
    let program = fleet::script(
        &work.join("once.sh"),
        &format!("echo \"$PWD\" >> {}", effects.display()),
    )?;
    let program = program.to_string_lossy().into_owned();
    let repeat = RUNS_PER_KILL.to_string();

    let started = Instant::now();
    let mut rng = Lcg(std::process::id() as u64 ^ started.elapsed().as_nanos() as u64);
    let mut agent = start_agent(&bin, &work)?;
    fleet::wait_for_log(
        &work.join("agent.log"),
        "session open",
        Duration::from_secs(30),
    )?;
    let mut sets = Vec::new();
    let mut rows = Vec::new();
    for kill in 0..kills {
        let set = coordinator(&["run", "--all", "--repeat", &repeat, "--program", &program])?;
        sets.push(set.trim().to_string());
        std::thread::sleep(Duration::from_millis(rng.below(150)));
        drop(agent);
        agent = start_agent(&bin, &work)?;
        if kill % KILLS_PER_SETTLE == KILLS_PER_SETTLE - 1 || kill + 1 == kills {
            rows.extend(settle(&coordinator, &std::mem::take(&mut sets))?);
            eprintln!(
                "{} kills, {} runs ended, {:.0} s",
                kill + 1,
                rows.len(),
                started.elapsed().as_secs_f64()
            );
        }
    }
    drop(agent);
    let elapsed = started.elapsed().as_secs_f64();

    let mut executed: HashMap<String, usize> = HashMap::new();
    for line in std::fs::read_to_string(&effects)
        .unwrap_or_default()
        .lines()
    {
        let run = Path::new(line)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned());
        *executed.entry(run.unwrap_or_default()).or_insert(0) += 1;
    }
    // Every line of the side-effect file must belong to a row: nothing ran that was not asked for.
    let strays = executed.len().saturating_sub(rows.len());
    let mut once = 0;
    let mut twice = 0;
    let mut never = 0;
    let mut duplicate_events = 0;
    let mut not_finished = 0;
    for row in &rows {
        let run = row["run_id"].as_str().unwrap_or_default();
        match executed.get(run).copied().unwrap_or(0) {
            0 => never += 1,
            1 => once += 1,
            _ => twice += 1,
        }
        let mut ids: Vec<u64> = row["events"]
            .as_array()
            .map(|e| e.iter().filter_map(|v| v.as_u64()).collect())
            .unwrap_or_default();
        let n = ids.len();
        ids.sort();
        ids.dedup();
        duplicate_events += n - ids.len();
        if row["state"] != "finished" {
            not_finished += 1;
        }
    }
    let markdown = format!(
        "## soak\n\n\
         `cargo xtask soak --kills {kills}`: the agent SIGKILLed at a random moment (0 to 150 ms) \
         after each submission ({RUNS_PER_KILL} runs in one set per kill, in flight as it dies), then \
         restarted; every {KILLS_PER_SETTLE} kills the runs so far are waited for and their rows \
         read; debug build, loopback, one coordinator, one node. Nomad's own restart test does 10 \
         kills.\n\n\
         | figure | value |\n|---|---|\n\
         | SIGKILLs of the agent | {kills} |\n\
         | runs | {runs} |\n\
         | executed exactly once (side effect written once) | {once} |\n\
         | executed twice or more | {twice} |\n\
         | never executed | {never} |\n\
         | side effects of runs nobody asked for | {strays} |\n\
         | rows not `finished` | {not_finished} |\n\
         | duplicate events in the coordinator's record | {duplicate_events} |\n\
         | wall time | {elapsed:.0} s |\n",
        runs = rows.len(),
    );
    println!("{markdown}");
    util::record_benchmark("soak", &markdown)?;
    if twice + never + strays + duplicate_events + not_finished > 0 {
        bail!(
            "exactly-once broke: see the figures above and {}",
            work.display()
        );
    }
    Ok(())
}

/// Waits, with the agent alive, until every run of `sets` has ended; returns their rows.
fn settle(
    coordinator: &dyn Fn(&[&str]) -> Result<String>,
    sets: &[String],
) -> Result<Vec<serde_json::Value>> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let mut rows = Vec::new();
        for set in sets {
            let out = coordinator(&["status", "--set", set, "--json"])?;
            let set_rows: serde_json::Value = serde_json::from_str(&out)?;
            rows.extend(set_rows.as_array().cloned().unwrap_or_default());
        }
        let open = rows
            .iter()
            .filter(|r| !matches!(r["state"].as_str(), Some("finished" | "failed" | "lost")))
            .count();
        if open == 0 {
            return Ok(rows);
        }
        if Instant::now() > deadline {
            bail!("{open} runs never ended");
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

fn start_agent(bin: &Path, work: &Path) -> Result<Proc> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(work.join("agent.log"))?;
    Proc::spawn(
        fleet::agent(bin, &work.join("fleet.json"), work)
            .args(["--retry-base", "50ms"])
            .stdout(Stdio::null())
            .stderr(log),
    )
}

/// A small generator, so xtask needs no extra dependency.
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}
