//! A machine's agent updating itself from a signed release, under a stand-in for systemd's
//! `Restart=always` (a shell loop that starts the unit's `ExecStart`, the install folder's
//! `fleet-agent`, again whenever it exits): a good release is kept after its trial, with a run
//! that was out at the swap executed once; bad ones (exit 1 at start, a crash 10 s in, a hang, no
//! session) are reverted within 30 s, reported, and never tried again; 20 machines upgrade under
//! runs and 100 SIGKILLs, on redb and on PostgreSQL.
use serde_json::Value;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use testkit::agent::{Coordinator, script, wait_until};
use testkit::release::ReleaseKeys;

const WAIT: Duration = Duration::from_secs(60);

/// Each test here runs a fleet of real agents (up to 20) swapping 150 MB debug binaries: one at a
/// time, so four of them at once (CI's `--test-threads=4`) do not share 2 cores.
static ONE_FLEET_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_fleet_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_FLEET_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}
/// The trial given to the machines here (the default is 20 s).
const TRIAL: &str = "10s";

/// `ExecStart` run again after every exit but the fleet's end (78), as systemd's unit does.
const UNIT: &str = r#"while :; do "$0" "$@"; rc=$?; echo "unit: the agent exited with $rc" >&2; [ "$rc" = 78 ] && exit 78; sleep 0.5; done"#;

/// A machine: its install folder holds the bootstrap's plain binaries, its agent runs under the
/// stand-in unit; the whole process group is killed on drop.
struct Machine {
    dir: PathBuf,
    log: PathBuf,
    unit: Child,
}

impl Machine {
    fn start(dir: &Path, join: &str) -> Machine {
        Machine::with_trial(dir, join, TRIAL)
    }

    /// A machine whose agent gives a new release `trial` (keeping it after half).
    fn with_trial(dir: &Path, join: &str, trial: &str) -> Machine {
        let opt = dir.join("opt");
        std::fs::create_dir_all(&opt).unwrap();
        for name in ["fleet-agent", "fleet-run-supervisor"] {
            std::fs::copy(testkit::bin(name), opt.join(name)).unwrap();
        }
        std::fs::write(dir.join("fleet.json"), join).unwrap();
        let agent = testkit::agent::machine_command(dir);
        let log = dir.join("agent.log");
        let mut unit = Command::new("sh");
        unit.arg("-c")
            .arg(UNIT)
            .arg(opt.join("fleet-agent"))
            .args(agent.get_args())
            .arg("--install-dir")
            .arg(&opt)
            .args(["--update-trial", trial])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .process_group(0);
        Machine {
            dir: dir.to_path_buf(),
            log,
            unit: unit.spawn().unwrap(),
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn opt(&self) -> PathBuf {
        self.dir.join("opt")
    }
}

impl Drop for Machine {
    fn drop(&mut self) {
        // The unit, the agent, its watchdog: the whole group.
        let _ = Command::new("kill")
            .args(["-s", "KILL", "--", &format!("-{}", self.unit.id())])
            .status();
        let _ = self.unit.wait();
    }
}

/// Seconds of the day of a log line's timestamp (`2026-12-04T16:10:02.447968Z ...`).
fn logged_at(line: &str) -> f64 {
    let time = &line[11..26];
    let (h, m, s) = (&time[0..2], &time[3..5], &time[6..]);
    h.parse::<f64>().unwrap() * 3600.0
        + m.parse::<f64>().unwrap() * 60.0
        + s.parse::<f64>().unwrap()
}

/// From the old agent's last line before its exec to the new agent's first session, and whether
/// that session came at the first try (no session lost and retried in between).
fn swap_to_session_ms(log: &str) -> (u64, bool) {
    let after: Vec<&str> = (log.lines())
        .skip_while(|l| !l.contains("installed a release; restarting"))
        .collect();
    let swapped = after.first().expect("the swap is logged");
    let open = (after.iter())
        .position(|l| l.contains("session open"))
        .expect("a session after the swap");
    let first_try = !after[..open].iter().any(|l| l.contains("reconnecting"));
    let ms = ((logged_at(after[open]) - logged_at(swapped)) * 1000.0) as u64;
    (ms, first_try)
}

fn release_facts(coord: &Coordinator) -> Value {
    coord.nodes()[0]["facts"]["release"].clone()
}

/// Waits until the node's release facts satisfy `check`; answers them and how long it took.
fn wait_release(coord: &Coordinator, check: impl Fn(&Value) -> bool) -> (Value, Duration) {
    let since = Instant::now();
    let ok = wait_until(WAIT, || check(&release_facts(coord)));
    let facts = release_facts(coord);
    assert!(ok, "the node's release facts stayed {facts:#}");
    (facts, since.elapsed())
}

/// The run of `set` finished, and its program left one mark in `marks`: it ran once.
fn ran_once_and_finished(
    coord: &Coordinator,
    machine: &Machine,
    set: &str,
    marks: &Path,
    timeout: Duration,
) {
    let finished = wait_until(timeout, || {
        let out = testkit::ok(coord.command().args(["status", "--set", set, "--json"]));
        serde_json::from_str::<Value>(&out).unwrap()[0]["state"] == "finished"
    });
    assert!(finished, "{}", machine.log_text());
    assert_eq!(std::fs::read_to_string(marks).unwrap(), "ran\n");
}

/// `run TARGET --program PROGRAM` through `coord`; answers the set's id.
fn run_program(coord: &Coordinator, target: &[&str], program: &Path) -> String {
    let mut run = coord.command();
    run.arg("run").args(target).arg("--program").arg(program);
    testkit::ok(&mut run).trim().to_string()
}

/// This build's binaries, as a release's bundle carries them.
struct Build {
    agent: Vec<u8>,
    supervisor: Vec<u8>,
}

impl Build {
    fn read() -> Build {
        Build {
            agent: std::fs::read(testkit::bin("fleet-agent")).unwrap(),
            supervisor: std::fs::read(testkit::bin("fleet-run-supervisor")).unwrap(),
        }
    }

    /// Signs release `sequence` (this build's supervisor, and `agent`, else this build's) and
    /// has the fleet take it in.
    fn add(&self, coord: &Coordinator, keys: &ReleaseKeys, sequence: u64, agent: Option<&[u8]>) {
        let release = keys.release(
            sequence,
            &[
                ("fleet-agent", agent.unwrap_or(&self.agent)),
                ("fleet-run-supervisor", &self.supervisor),
            ],
        );
        testkit::ok(coord.command().args(["release", "add"]).arg(&release));
    }
}

/// A serving coordinator whose fleet trusts the root of `keys` (before any token is minted).
fn fleet_trusting_a_root(dir: &Path) -> (Coordinator, ReleaseKeys) {
    fleet_trusting_a_root_with(dir, &[])
}

/// [`fleet_trusting_a_root`] with `serve` flags besides the fast defaults.
fn fleet_trusting_a_root_with(dir: &Path, flags: &[&str]) -> (Coordinator, ReleaseKeys) {
    let coord = Coordinator::start(&dir.join("coord"), flags);
    let keys = ReleaseKeys::new(&dir.join("keys"));
    let trusted = testkit::ok(
        coord
            .command()
            .args(["release", "trust", "--root", &keys.root]),
    );
    assert_eq!(trusted.trim(), keys.root);
    (coord, keys)
}

/// Releases whose agent fails its trial, each as (sequence, the agent, the revert's reason): one
/// that exits at its start; a real agent that holds its session, passes its self-check and is
/// killed 10 s in; a real agent that cannot reach any coordinator (a network namespace of its
/// own), which reverts itself, blamed on the release once the restored agent holds a session.
fn bad_releases() -> Vec<(u64, String, &'static str)> {
    let agent = testkit::bin("fleet-agent");
    vec![
        (
            6,
            "#!/bin/sh\nexit 1\n".into(),
            "the new agent exited during its trial",
        ),
        (
            7,
            format!(
                "#!/bin/sh\ntimeout -s KILL 10 {} \"$@\"\nexit 1\n",
                agent.display()
            ),
            "the new agent exited during its trial",
        ),
        (
            9,
            format!("#!/bin/sh\nexec unshare -n {} \"$@\"\n", agent.display()),
            "no session within 20 s",
        ),
    ]
}

fn update(coord: &Coordinator, release: Option<u64>) -> std::process::Output {
    let mut cmd = coord.command();
    cmd.args(["update", "--node", "m"]);
    if let Some(sequence) = release {
        cmd.args(["--release", &sequence.to_string()]);
    }
    testkit::output(&mut cmd)
}

#[test]
fn a_good_release_is_kept_and_bad_ones_are_reverted_and_never_tried_again() {
    let _fleet = one_fleet_at_a_time();
    let tmp = testkit::tempdir();
    let dir = tmp.path();
    let (coord, keys) = fleet_trusting_a_root(dir);
    let join = coord.token(&["--name", "m"]);
    assert!(
        join.contains(&keys.root),
        "the join file names the roots: {join}"
    );
    // The default trial, 20 s: a release that crashes 10 s in is still on trial then (kept at 15 s).
    let machine = Machine::with_trial(&dir.join("m"), &join, "20s");
    assert!(
        wait_until(WAIT, || machine.log_text().contains("session open")),
        "{}",
        machine.log_text()
    );
    let (facts, _) = wait_release(&coord, |r| r["sequence"] == 0);
    assert!(facts.get("update").is_none(), "{facts:#}");

    // A good release: the same agent, as release 5. A run is out while it swaps.
    let build = Build::read();
    build.add(&coord, &keys, 5, None);
    let marks = dir.join("marks");
    let program = script(
        &dir.join("p.sh"),
        &format!("echo ran >> {}; sleep 4", marks.display()),
    );
    let set = run_program(&coord, &["--node", "m"], &program);
    assert!(wait_until(WAIT, || marks.exists()), "the run did not start");
    let sent = update(&coord, None);
    let said = String::from_utf8_lossy(&sent.stdout);
    assert!(
        sent.status.success(),
        "{}",
        String::from_utf8_lossy(&sent.stderr)
    );
    assert!(
        said.contains("restarts from release 0 into 5 on trial"),
        "{said}"
    );
    let (facts, took) = wait_release(&coord, |r| r["update"]["state"] == "kept");
    assert_eq!(facts["sequence"], 5, "{facts:#}");
    assert_eq!(
        facts["update"],
        serde_json::json!({ "state": "kept", "from": 0, "to": 5 })
    );
    eprintln!(
        "release 5 kept {} ms after the update was sent; the new agent held a session {} ms after the swap",
        took.as_millis(),
        swap_to_session_ms(&machine.log_text()).0
    );
    let current = std::fs::read_link(machine.opt().join("current")).unwrap();
    assert_eq!(current, Path::new("releases/5"));
    assert!(
        std::fs::symlink_metadata(machine.opt().join("fleet-agent"))
            .unwrap()
            .is_symlink()
    );
    // The run out at the swap was re-adopted and reported once: it ran once and finished.
    ran_once_and_finished(&coord, &machine, set.trim(), &marks, WAIT);
    // The release's folder holds the binaries; the content cache keeps no second copy.
    for (name, bytes) in [
        ("fleet-agent", &build.agent),
        ("fleet-run-supervisor", &build.supervisor),
    ] {
        let digest = testkit::oci::sha256_digest(bytes);
        let hex = digest.trim_start_matches("sha256:");
        let cached = machine.dir.join("state/content/sha256").join(hex);
        assert!(
            !cached.exists(),
            "{name} is still cached at {}",
            cached.display()
        );
        assert_eq!(
            &std::fs::read(machine.opt().join("releases/5").join(name)).unwrap(),
            bytes
        );
    }

    // Bad releases, each reverted to 5 within 30 s, named in the facts, and never tried again.
    let mut bad = bad_releases();
    bad.insert(
        2,
        (
            8,
            "#!/bin/sh\nexec sleep 600\n".into(),
            "the new agent neither kept nor reverted",
        ),
    );
    for (sequence, agent, reason) in bad {
        build.add(&coord, &keys, sequence, Some(agent.as_bytes()));
        let sent = update(&coord, Some(sequence));
        assert!(
            sent.status.success(),
            "{}",
            String::from_utf8_lossy(&sent.stderr)
        );
        let (facts, took) = wait_release(&coord, |r| {
            r["update"]["state"] == "reverted"
                && r["update"]["to"] == sequence
                && r["sequence"] == 5
        });
        let said = facts["update"]["reason"].as_str().unwrap();
        assert!(said.starts_with(reason), "{facts:#}");
        eprintln!(
            "release {sequence} reverted {} ms after the update was sent: {said}",
            took.as_millis()
        );
        assert!(
            took < Duration::from_secs(30),
            "release {sequence} took {took:?} to revert"
        );
        assert_eq!(
            std::fs::read_link(machine.opt().join("current")).unwrap(),
            Path::new("releases/5")
        );
        let again = update(&coord, Some(sequence));
        let refused = String::from_utf8_lossy(&again.stderr);
        assert!(!again.status.success());
        assert!(
            refused.contains(&format!(
                "release {sequence} was reverted on this machine ({reason}"
            )),
            "{refused}"
        );
        assert!(refused.contains("it is never tried again"), "{refused}");
    }
    // The last refusal is in the facts, and so in `nodes`.
    let (facts, _) = wait_release(&coord, |r| r["update"]["state"] == "refused");
    assert_eq!(facts["sequence"], 5, "{facts:#}");
    let text = testkit::ok(coord.command().arg("nodes"));
    assert!(
        text.lines().nth(1).unwrap().contains(" 5        refused "),
        "{text}"
    );
}

fn rollout_status(coord: &Coordinator) -> Value {
    let out = testkit::ok(coord.command().args(["rollout", "status", "--json"]));
    serde_json::from_str(&out).unwrap()
}

#[test]
fn a_rollout_takes_the_fleet_through_its_stages_and_halts_at_a_bad_canary() {
    let _fleet = one_fleet_at_a_time();
    let tmp = testkit::tempdir();
    let dir = tmp.path();
    let (coord, keys) = fleet_trusting_a_root(dir);
    let machines: Vec<Machine> = (0..3)
        .map(|i| {
            let join = coord.token(&["--name", &format!("m{i}")]);
            Machine::with_trial(&dir.join(format!("m{i}")), &join, "20s")
        })
        .collect();
    let joined = wait_until(WAIT, || {
        let nodes = coord.nodes();
        nodes.len() == 3 && nodes.iter().all(|n| n["facts"]["release"]["sequence"] == 0)
    });
    assert!(joined, "{:#?}", coord.nodes());
    let build = Build::read();
    build.add(&coord, &keys, 5, None);
    let start = |release: &str| {
        testkit::ok(coord.command().args([
            "rollout",
            "start",
            "--release",
            release,
            "--canaries",
            "1",
            "--waves",
            "50%,100%",
            "--wait",
            "1s",
            "--halt-at",
            "10%",
        ]))
    };
    let said = start("5");
    assert!(said.starts_with("release 5: running at stage 0"), "{said}");
    // `--watch` follows it to the end: a line each time it changes, then the table.
    let watched = coord.watch_rollout(120);
    let (out, status) = (
        String::from_utf8_lossy(&watched.stdout),
        rollout_status(&coord),
    );
    assert_eq!(watched.status.code(), Some(0), "{watched:?}\n{status:#}");
    assert!(
        out.starts_with("release 5: running, the canaries: 0 of "),
        "{out}"
    );
    assert!(
        out.contains("\nrelease 5: done: 3 of 3 kept, 0 failed\nrelease 5: done at stage"),
        "{out}"
    );
    let machines_of = |stage: u64| {
        (status["machines"].as_object().unwrap().values())
            .filter(|m| m["stage"] == stage)
            .count()
    };
    assert_eq!(
        (machines_of(0), machines_of(1), machines_of(2)),
        (1, 1, 1),
        "{status:#}"
    );
    assert!(
        coord
            .nodes()
            .iter()
            .all(|n| n["facts"]["release"]["sequence"] == 5)
    );

    let refused = testkit::fails(coord.command().args(["rollout", "resume"]));
    assert!(
        refused.contains("the rollout of release 5 is done: it cannot become running"),
        "{refused}"
    );
    // Three bad releases, each rolled out: the canary reverts, the rollout halts there by itself
    // and says why, and no machine beyond the canary is touched.
    for (sequence, agent, reason) in bad_releases() {
        build.add(&coord, &keys, sequence, Some(agent.as_bytes()));
        start(&sequence.to_string());
        let watched = coord.watch_rollout(90);
        let status = rollout_status(&coord);
        assert_eq!(watched.status.code(), Some(1), "{watched:?}\n{status:#}");
        let said = String::from_utf8_lossy(&watched.stderr);
        let why = status["reason"].as_str().unwrap();
        assert!(
            said.trim_end().ends_with(&format!("halted: {why}")),
            "{said}"
        );
        assert!(
            why.starts_with(
                "1 of 1 machines of the canaries failed (100%, above the 10% allowed); n-"
            ),
            "{why}"
        );
        assert!(why.contains(&format!("reverted: {reason}")), "{why}");
        std::thread::sleep(Duration::from_secs(3));
        let status = rollout_status(&coord);
        assert_eq!(
            status["machines"].as_object().unwrap().len(),
            1,
            "{status:#}"
        );
        let nodes = coord.nodes();
        assert!(
            nodes.iter().all(|n| n["facts"]["release"]["sequence"] == 5),
            "{nodes:#?}"
        );
        let touched = nodes
            .iter()
            .filter(|n| n["facts"]["release"]["update"]["to"] == sequence)
            .count();
        assert_eq!(touched, 1, "{nodes:#?}");
        let text = testkit::ok(coord.command().args(["rollout", "status"]));
        assert!(
            text.contains("halted: 1 of 1 machines of the canaries failed"),
            "{text}"
        );
        eprintln!("release {sequence} halted the rollout at its canary: {why}");
        testkit::ok(coord.command().args(["rollout", "abort"]));
    }
    drop(machines);
}

/// The agent process the stand-in unit runs now (its child), if any.
fn agent_pid(machine: &Machine) -> Option<u32> {
    let children = std::fs::read_to_string(format!(
        "/proc/{pid}/task/{pid}/children",
        pid = machine.unit.id()
    ))
    .ok()?;
    children.split_whitespace().next()?.parse().ok()
}

#[test]
fn sigkill_at_random_moments_of_a_swap_leaves_the_old_or_the_new_agent_and_runs_once() {
    let _fleet = one_fleet_at_a_time();
    let tmp = testkit::tempdir();
    let dir = tmp.path();
    let (coord, keys) = fleet_trusting_a_root_with(dir, &["--lease", LEASE]);
    let machine = Machine::start(&dir.join("m"), &coord.token(&["--name", "m"]));
    let build = Build::read();
    let marks = dir.join("marks");
    let program = script(
        &dir.join("p.sh"),
        &format!("echo ran >> {}; sleep 20", marks.display()),
    );
    assert!(wait_until(WAIT, || machine
        .log_text()
        .contains("session open")));
    let set = run_program(&coord, &["--node", "m"], &program);
    assert!(wait_until(WAIT, || marks.exists()), "the run did not start");
    // Moments spread over the swap: the fetch, the install, the switch, the exec, the trial.
    let kills = 12u64;
    for i in 0..kills {
        let sequence = 10 + i;
        build.add(&coord, &keys, sequence, None);
        let before = machine.log_text().matches("session open").count();
        let mut update = coord.command();
        update.args(["update", "--node", "m", "--release", &sequence.to_string()]);
        let sending = update
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(i * 1_500 / kills));
        if let Some(pid) = agent_pid(&machine) {
            let _ = Command::new("kill")
                .args(["-s", "KILL", &pid.to_string()])
                .status();
        }
        drop(sending);
        // Whatever the moment, the unit's binary is whole and an agent holds a session again.
        let back = wait_until(WAIT, || {
            machine.log_text().matches("session open").count() > before
                && release_facts(&coord)["update"]["state"] != "trial"
        });
        assert!(back, "kill {i}: {}", machine.log_text());
        let unit_binary = std::fs::read(machine.opt().join("fleet-agent")).unwrap();
        assert_eq!(
            unit_binary, build.agent,
            "kill {i}: the unit's binary is not a whole agent"
        );
        let facts = release_facts(&coord);
        eprintln!("kill {i} after {} ms: {facts}", i * 1_500 / kills);
    }
    // The run out through all of it ran once, and ends once.
    ran_once_and_finished(
        &coord,
        &machine,
        set.trim(),
        &marks,
        Duration::from_secs(90),
    );
}

/// The whole swap of the last release taken: from its first line (before the fetch) to the new
/// agent's first session.
fn last_swap_ms(log: &str) -> u64 {
    let began = log.lines().rfind(|l| l.contains("taking release"));
    let began = began.expect("a swap is logged");
    let after = log.split(began).nth(1).unwrap();
    let open = (after.lines())
        .skip_while(|l| !l.contains("installed a release; restarting"))
        .find(|l| l.contains("session open"))
        .expect("a session after the swap");
    ((logged_at(open) - logged_at(began)) * 1000.0) as u64
}

/// The fleet's nodes by name.
fn nodes_by_name(coord: &Coordinator) -> std::collections::BTreeMap<String, Value> {
    (coord.nodes().into_iter())
        .map(|n| (n["name"].as_str().unwrap_or_default().to_string(), n))
        .collect()
}

/// Every row of `sets` final, read through `coord`.
fn final_rows(coord: &Coordinator, sets: &[String], timeout: Duration) -> Vec<Value> {
    let mut rows = Vec::new();
    let all_final = wait_until(timeout, || {
        rows = sets.iter().flat_map(|s| coord.rows(s)).collect();
        rows.iter().all(|r| {
            ["finished", "failed", "lost", "stopped"].contains(&r["state"].as_str().unwrap())
        })
    });
    assert!(all_final, "rows not final: {rows:#?}");
    rows
}

/// Each run of `rows` finished, and its program (which writes its folder, named for the run,
/// to `marks`) ran exactly once.
fn each_ran_exactly_once(rows: &[Value], marks: &Path) {
    let text = std::fs::read_to_string(marks).unwrap_or_default();
    let mut ran: std::collections::BTreeMap<&str, usize> = Default::default();
    for line in text.lines() {
        *ran.entry(line.rsplit('/').next().unwrap()).or_default() += 1;
    }
    for row in rows {
        assert_eq!(row["state"], "finished", "{row:#}");
        let run = row["run_id"].as_str().unwrap();
        assert_eq!(
            ran.get(run),
            Some(&1),
            "run {run} ran {:?} times",
            ran.get(run)
        );
    }
    assert_eq!(ran.len(), rows.len(), "marks of runs no row names: {ran:?}");
}

/// The lease of the fleets whose agents are killed under a run: `serve`'s default, not the tests'
/// fast 2 s. Agents killed (twenty at once) and restarted by their units on a busy machine of 2
/// cores can take more than 2 s to say hello again, which would end their runs `lost` (correctly,
/// for that lease).
const LEASE: &str = "20s";

/// 20 machines under the stand-in unit, on `coords` (one on redb, or two sharing PostgreSQL,
/// each with a controller): a rollout takes them all to the new release while 200 runs are
/// dispatched, each back in a session soon after its swap; then 100 SIGKILLs at spread moments
/// of five more swaps leave each machine on its old or new agent, whole, and no run doubled.
fn twenty_machines_upgrade_under_runs_and_kills(
    dir: &Path,
    coords: &[Coordinator],
    keys: &ReleaseKeys,
) {
    const MACHINES: usize = 20;
    let first = &coords[0];
    let machines: Vec<Machine> = (0..MACHINES)
        .map(|i| {
            let name = format!("m{i}");
            let join = coords[i % coords.len()].token(&["--name", &name]);
            Machine::start(&dir.join(&name), &join)
        })
        .collect();
    let joined = wait_until(Duration::from_secs(120), || {
        let nodes = first.nodes();
        nodes.len() == MACHINES && nodes.iter().all(|n| n["facts"]["release"]["sequence"] == 0)
    });
    assert!(joined, "{:#?}", first.nodes());
    let build = Build::read();
    build.add(first, keys, 5, None);
    let marks = dir.join("marks");
    let program = script(
        &dir.join("p.sh"),
        &format!("echo \"$PWD\" >> {}; sleep 2", marks.display()),
    );
    // 10 sets of a run on every machine, asked for through each coordinator in turn while the
    // rollout goes.
    let runs = std::thread::scope(|scope| {
        let asking = scope.spawn(|| {
            (0..10)
                .map(|i| {
                    std::thread::sleep(Duration::from_millis(700));
                    run_program(&coords[i % coords.len()], &["--all"], &program)
                })
                .collect::<Vec<String>>()
        });
        testkit::ok(first.command().args([
            "rollout",
            "start",
            "--release",
            "5",
            "--canaries",
            "2",
            "--waves",
            "50%,100%",
            "--wait",
            "1s",
            "--halt-at",
            "10%",
        ]));
        let watched = first.watch_rollout(240);
        assert_eq!(
            watched.status.code(),
            Some(0),
            "{watched:?}\n{:#}",
            rollout_status(first)
        );
        asking.join().unwrap()
    });
    let nodes = nodes_by_name(first);
    for (name, node) in &nodes {
        assert_eq!(
            node["facts"]["release"],
            serde_json::json!({"sequence": 5, "update": {"state": "kept", "from": 0, "to": 5}}),
            "{name}"
        );
    }
    let back: Vec<(u64, bool)> = machines
        .iter()
        .map(|m| swap_to_session_ms(&m.log_text()))
        .collect();
    // How soon is the machine's to say (the figure, printed): the agent's part is to open its
    // session at its first try after the swap, with no session lost and retried in between.
    assert!(
        back.iter().all(|(_, first_try)| *first_try),
        "a machine retried its session after its swap: {back:?}"
    );
    let mut back_ms: Vec<u64> = back.iter().map(|(ms, _)| *ms).collect();
    back_ms.sort();
    eprintln!(
        "{MACHINES} machines swapped to release 5 under 200 runs: back in a session after the swap in {} ms (median), {} ms (max)",
        back_ms[MACHINES / 2],
        back_ms[MACHINES - 1]
    );
    let mut swaps: Vec<u64> = machines
        .iter()
        .map(|m| last_swap_ms(&m.log_text()))
        .collect();
    swaps.sort();
    eprintln!(
        "the whole swap, fetch to the new agent's session: {} ms (median), {} ms (max)",
        swaps[MACHINES / 2],
        swaps[MACHINES - 1]
    );
    let rows = final_rows(first, &runs, Duration::from_secs(180));
    assert_eq!(rows.len(), 10 * MACHINES);
    each_ran_exactly_once(&rows, &marks);

    // 100 kills: five more releases, each sent to all 20, each agent killed at its own moment.
    std::fs::remove_file(&marks).unwrap();
    let long = script(
        &dir.join("long.sh"),
        &format!("echo \"$PWD\" >> {}; sleep 20", marks.display()),
    );
    let out_set = run_program(first, &["--all"], &long);
    assert!(
        wait_until(WAIT, || std::fs::read_to_string(&marks)
            .unwrap_or_default()
            .lines()
            .count()
            == MACHINES),
        "the long runs did not all start"
    );
    let window = swaps[MACHINES - 1] + 1000;
    let mut running = [5u64; MACHINES];
    for round in 0..5u64 {
        let sequence = 10 + round;
        build.add(first, keys, sequence, None);
        let count = |needle: &str| -> Vec<usize> {
            machines
                .iter()
                .map(|m| m.log_text().matches(needle).count())
                .collect()
        };
        let (opened, taking) = (count("session open"), count("taking release"));
        std::thread::scope(|scope| {
            for (i, machine) in machines.iter().enumerate() {
                let (coord, taking) = (&coords[i % coords.len()], &taking);
                scope.spawn(move || {
                    let mut update = coord.command();
                    let node = format!("m{i}");
                    update.args([
                        "update",
                        "--node",
                        &node,
                        "--release",
                        &sequence.to_string(),
                    ]);
                    let sending = update
                        .stdout(Stdio::null())
                        .stderr(Stdio::null())
                        .spawn()
                        .unwrap();
                    let began = wait_until(WAIT, || {
                        machine.log_text().matches("taking release").count() > taking[i]
                    });
                    assert!(began, "round {round}, {node} never began the swap");
                    // From the swap's first line, spread over the longest whole swap measured
                    // above and a second of the trial: the fetch, the install, the switch, the
                    // exec, the new agent's start and session.
                    let moment = (i as u64 * 7 + round * 13) % 20 * window / 20;
                    std::thread::sleep(Duration::from_millis(moment));
                    if let Some(pid) = agent_pid(machine) {
                        let _ = Command::new("kill")
                            .args(["-s", "KILL", &pid.to_string()])
                            .status();
                    }
                    // Its answer does not matter: the facts say how the swap ended.
                    drop(sending);
                });
            }
        });
        let back = wait_until(Duration::from_secs(120), || {
            let nodes = nodes_by_name(first);
            machines.iter().enumerate().all(|(i, m)| {
                m.log_text().matches("session open").count() > opened[i]
                    && nodes[&format!("m{i}")]["facts"]["release"]["update"]["state"] != "trial"
            })
        });
        assert!(back, "round {round}: {:#?}", nodes_by_name(first));
        for (i, machine) in machines.iter().enumerate() {
            let unit_binary = std::fs::read(machine.opt().join("fleet-agent")).unwrap();
            assert!(
                unit_binary == build.agent,
                "round {round}, m{i}: the unit's binary is not a whole agent"
            );
        }
        // Each machine runs what its `current` link names: the release before or the new one.
        let nodes = nodes_by_name(first);
        let mut outcomes: std::collections::BTreeMap<String, usize> = Default::default();
        for (i, machine) in machines.iter().enumerate() {
            let release = &nodes[&format!("m{i}")]["facts"]["release"];
            let on = release["sequence"].as_u64().unwrap();
            let current = std::fs::read_link(machine.opt().join("current")).unwrap();
            assert_eq!(
                current,
                PathBuf::from(format!("releases/{on}")),
                "round {round}, m{i}"
            );
            assert!(
                on == running[i] || on == sequence,
                "round {round}, m{i}: {release}"
            );
            let word = match release["update"]["to"].as_u64() == Some(sequence) {
                true => release["update"]["state"].as_str().unwrap().to_string(),
                false => "never installed".to_string(),
            };
            *outcomes.entry(word).or_default() += 1;
            running[i] = on;
        }
        eprintln!("kill round {round}, release {sequence}: {outcomes:?}");
    }
    let rows = final_rows(
        first,
        &[out_set.trim().to_string()],
        Duration::from_secs(120),
    );
    each_ran_exactly_once(&rows, &marks);
    drop(machines);
}

#[test]
fn twenty_machines_on_one_coordinator_upgrade_under_runs_and_kills() {
    let _fleet = one_fleet_at_a_time();
    let tmp = testkit::tempdir();
    let (coord, keys) = fleet_trusting_a_root_with(tmp.path(), &["--lease", LEASE]);
    twenty_machines_upgrade_under_runs_and_kills(tmp.path(), std::slice::from_ref(&coord), &keys);
}

#[test]
fn twenty_machines_on_two_coordinators_sharing_postgres_upgrade_under_runs_and_kills() {
    let _fleet = one_fleet_at_a_time();
    let tmp = testkit::tempdir();
    let dir = tmp.path();
    let pg = testkit::postgres::Postgres::start();
    let url = pg.fresh_database();
    let a = Coordinator::start(&dir.join("coord-0"), &["--store", &url, "--lease", LEASE]);
    std::fs::create_dir(dir.join("coord-1")).unwrap();
    let key = fleet_coordinator::KEY_FILE;
    std::fs::copy(dir.join("coord-0").join(key), dir.join("coord-1").join(key)).unwrap();
    let b = Coordinator::start(&dir.join("coord-1"), &["--store", &url, "--lease", LEASE]);
    let both = wait_until(WAIT, || {
        let join: Value = serde_json::from_str(&a.token(&[])).unwrap();
        join["alternates"].as_array().map_or(0, Vec::len) == 1
    });
    assert!(both, "the coordinators never knew each other");
    let keys = ReleaseKeys::new(&dir.join("keys"));
    testkit::ok(b.command().args(["release", "trust", "--root", &keys.root]));
    twenty_machines_upgrade_under_runs_and_kills(dir, &[a, b], &keys);
}
