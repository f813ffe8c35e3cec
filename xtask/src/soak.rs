//! `cargo xtask soak`: SIGKILL the agent at random moments across many runs; every run happens once.
//!
//! The same loop as the crash-loop test, longer: runs are submitted while the agent is killed and
//! restarted; at the end every run must have executed exactly once (each appends its own run
//! folder to a side-effect file) and reached the coordinator exactly once (no duplicate event).
use crate::{cross, util};
use anyhow::{Context, Result, bail};
use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Runs submitted per kill: one, so 1 000 kills stay within the coordinator's retention of the
/// newest 1 000 final runs and every row can be checked.
const RUNS_PER_KILL: usize = 1;

pub fn run(kills: usize) -> Result<()> {
    util::run(Command::new("cargo").args([
        "build",
        "--quiet",
        "-p",
        "fleet-agent",
        "-p",
        "fleet-run-supervisor",
    ]))?;
    let bin = cross::target_dir().join("debug/fleet-agent");
    let work = cross::target_dir().join("soak");
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work)?;
    let data = work.join("coordinator");
    let mut serve = Proc::spawn(
        Command::new(&bin)
            .args(["coordinator", "--data"])
            .arg(&data)
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--heartbeat",
                "200ms",
                "--lease",
                "5s",
            ])
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(work.join("coordinator.log"))?),
    )?;
    let mut line = String::new();
    BufReader::new(serve.0.stdout.take().expect("piped")).read_line(&mut line)?;
    let coordinator = |args: &[&str]| -> Result<String> {
        let out = Command::new(&bin)
            .args(["coordinator", "--data"])
            .arg(&data)
            .args(args)
            .output()?;
        if !out.status.success() {
            bail!(
                "coordinator {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    };
    std::fs::write(work.join("fleet.json"), coordinator(&["token"])?)?;
    let effects = work.join("effects");
    let program = work.join("once.sh");
    std::fs::write(
        &program,
        format!("#!/bin/sh\necho \"$PWD\" >> {}\n", effects.display()),
    )?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755))?;
    let program = program.to_string_lossy().into_owned();
    let repeat = RUNS_PER_KILL.to_string();

    let started = Instant::now();
    let mut rng = Lcg(std::process::id() as u64 ^ started.elapsed().as_nanos() as u64);
    let mut agent = start_agent(&bin, &work)?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while !std::fs::read_to_string(work.join("agent.log"))
        .unwrap_or_default()
        .contains("session open")
    {
        if Instant::now() > deadline {
            bail!(
                "the agent did not join: see {}",
                work.join("agent.log").display()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut sets = Vec::new();
    for kill in 0..kills {
        let set = coordinator(&["run", "--all", "--repeat", &repeat, "--program", &program])?;
        sets.push(set.trim().to_string());
        std::thread::sleep(Duration::from_millis(rng.below(150)));
        drop(agent);
        agent = start_agent(&bin, &work)?;
        if kill % 100 == 99 {
            eprintln!(
                "{} kills, {:.0} s",
                kill + 1,
                started.elapsed().as_secs_f64()
            );
        }
    }
    // Let everything end with the agent alive.
    let deadline = Instant::now() + Duration::from_secs(120);
    let rows = loop {
        let mut rows = Vec::new();
        for set in &sets {
            let out = coordinator(&["status", "--set", set, "--json"])?;
            let set_rows: serde_json::Value = serde_json::from_str(&out)?;
            rows.extend(set_rows.as_array().cloned().unwrap_or_default());
        }
        let open = rows
            .iter()
            .filter(|r| !matches!(r["state"].as_str(), Some("finished" | "failed" | "lost")))
            .count();
        if open == 0 {
            break rows;
        }
        if Instant::now() > deadline {
            bail!("{open} runs never ended");
        }
        std::thread::sleep(Duration::from_millis(500));
    };
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
         after each submission ({RUNS_PER_KILL} run per kill), then restarted; debug build, loopback, \
         one coordinator, one node. Nomad's own restart test does 10 kills.\n\n\
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

fn start_agent(bin: &Path, work: &Path) -> Result<Proc> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(work.join("agent.log"))?;
    Proc::spawn(
        Command::new(bin)
            .arg("--join-file")
            .arg(work.join("fleet.json"))
            .arg("--state")
            .arg(work.join("state"))
            .arg("--run-store")
            .arg(work.join("runs"))
            .arg("--cloud-root")
            .arg(work.join("cloud"))
            .args([
                "--accelerator-tool",
                "/nonexistent/nvidia-smi",
                "--retry-base",
                "50ms",
            ])
            .stdout(Stdio::null())
            .stderr(log),
    )
}

/// A child process SIGKILLed when dropped.
struct Proc(Child);

impl Proc {
    fn spawn(cmd: &mut Command) -> Result<Proc> {
        Ok(Proc(cmd.spawn().with_context(|| {
            format!("cannot start {:?}", cmd.get_program())
        })?))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
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
