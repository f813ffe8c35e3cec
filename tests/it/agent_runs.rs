//! Tests: agent_runs. Work reaches a machine exactly once: runs through the real coordinator,
//! agent and supervisor processes; SIGKILLed agents, a stopped coordinator, a killed supervisor.
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use testkit::agent::{Agent, Coordinator, script, wait_until};

const WAIT: Duration = Duration::from_secs(30);

/// A coordinator and one joined agent in a temporary directory.
struct Fleet {
    dir: tempfile::TempDir,
    coord: Coordinator,
    agent: Option<Agent>,
    starts: usize,
    /// Environment for the agent's process (a faked clock).
    agent_env: Vec<(String, String)>,
    /// Flags added to the agent's command line.
    agent_flags: Vec<String>,
}

/// The environment that runs a process with its wall clock `offset` away (libfaketime from
/// Debian's `faketime`); its monotonic clock stays true, as on a machine whose clock is unsynced.
fn clock_offset(offset: &str) -> Vec<(String, String)> {
    vec![
        (
            "LD_PRELOAD".into(),
            "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1".into(),
        ),
        ("FAKETIME".into(), offset.into()),
        ("DONT_FAKE_MONOTONIC".into(), "1".into()),
    ]
}

impl Fleet {
    fn new() -> Fleet {
        Fleet::with_agent_env(Vec::new())
    }

    fn with_agent_env(agent_env: Vec<(String, String)>) -> Fleet {
        Fleet::with_agent(agent_env, &[])
    }

    fn with_agent(agent_env: Vec<(String, String)>, agent_flags: &[&str]) -> Fleet {
        Fleet::with_setup(agent_env, agent_flags, |_| {})
    }

    /// Like [`with_agent`](Self::with_agent), with `setup` run on the fleet's folder before
    /// the agent starts.
    fn with_setup(
        agent_env: Vec<(String, String)>,
        agent_flags: &[&str],
        setup: impl FnOnce(&Path),
    ) -> Fleet {
        let dir = testkit::tempdir();
        setup(dir.path());
        let coord = Coordinator::start(&dir.path().join("coord"), &[]);
        std::fs::write(
            dir.path().join("fleet.json"),
            coord.token(&["--name", "worker"]),
        )
        .unwrap();
        let mut fleet = Fleet {
            dir,
            coord,
            agent: None,
            starts: 0,
            agent_env,
            agent_flags: agent_flags.iter().map(|f| f.to_string()).collect(),
        };
        fleet.start_joined_agent();
        fleet
    }

    /// Starts the agent and waits for its session to open.
    fn start_joined_agent(&mut self) {
        self.start_agent();
        let agent = self.agent.as_ref().unwrap();
        assert!(
            agent.wait_for("session open", 1, WAIT),
            "log: {}",
            agent.log_text()
        );
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn start_agent(&mut self) {
        self.starts += 1;
        let log = self.path(&format!("agent-{}.log", self.starts));
        let args: Vec<std::ffi::OsString> = vec![
            "--join-file".into(),
            self.path("fleet.json").into(),
            "--state".into(),
            self.path("state").into(),
            "--run-store".into(),
            self.path("runs").into(),
            "--cloud-root".into(),
            self.path("cloud").into(),
            "--accelerator-tool".into(),
            "/nonexistent/nvidia-smi".into(),
            "--retry-base".into(),
            "50ms".into(),
        ];
        let mut cmd = testkit::cmd("fleet-agent");
        cmd.args(args)
            .args(&self.agent_flags)
            .envs(self.agent_env.iter().cloned());
        self.agent = Some(Agent::spawn(&log, cmd));
    }

    fn kill_agent(&mut self) {
        if let Some(mut agent) = self.agent.take() {
            agent.kill();
        }
    }

    /// `coordinator run --all --program FILE EXTRA -- ARGS`; returns the set id.
    fn run(&self, program: &Path, extra: &[&str], args: &[&str]) -> String {
        let out = testkit::ok(
            self.coord
                .command()
                .args(["run", "--all", "--program"])
                .arg(program)
                .args(extra)
                .arg("--")
                .args(args),
        );
        out.trim().to_string()
    }

    /// A program that runs `first`, then appends its first argument to a side-effect file, so
    /// each execution leaves one line; returns (that file, the program).
    fn effect_program(&self, name: &str, first: &str) -> (PathBuf, PathBuf) {
        let effects = self.path("effects");
        let body = format!("{first}\necho \"$1\" >> {}", effects.display());
        (effects.clone(), script(&self.path(name), &body))
    }

    /// Whether the run store holds the run's result: its program and supervisor are done.
    fn ended_in_store(&self, run: &str) -> bool {
        let dir = self.path("runs").join("runs").join(run);
        dir.join("result.json").exists()
    }

    /// Starts `sleep 60` with a unique argument (to find its processes by) and waits until it
    /// runs; returns (that argument, the set id, the run id).
    fn run_sleeper(&self, name: &str) -> (String, String, String) {
        let token = format!("{name}-{}", std::process::id());
        let program = script(&self.path("long.sh"), "sleep 60");
        let set = self.run(&program, &[], &[&token]);
        let row = self.wait_row(&set, |r| r["state"] == "running");
        let run = row["run_id"].as_str().unwrap().to_string();
        (token, set, run)
    }

    fn status(&self, set: &str) -> Vec<Value> {
        self.coord.rows(set)
    }

    fn row(&self, set: &str) -> Value {
        self.status(set).remove(0)
    }

    /// Waits for a set's single row to satisfy `check`; returns it.
    fn wait_row(&self, set: &str, check: impl Fn(&Value) -> bool) -> Value {
        let mut last = Value::Null;
        let ok = wait_until(WAIT, || {
            last = self.row(set);
            check(&last)
        });
        assert!(ok, "row never matched: {last:#}");
        last
    }
}

fn is_final(row: &Value) -> bool {
    matches!(row["state"].as_str(), Some("finished" | "failed" | "lost"))
}

/// Each event id once, and at most one event per state.
fn assert_events_once(row: &Value) {
    let ids: Vec<u64> = row["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    let mut dedup = ids.clone();
    dedup.sort();
    dedup.dedup();
    assert_eq!(ids.len(), dedup.len(), "duplicate events in {row:#}");
}

#[test]
fn runs_with_arguments_and_a_timeout_then_collects_a_file() {
    let fleet = Fleet::new();
    let program = script(
        &fleet.path("greet.sh"),
        "printf 'args: %s\\n' \"$*\" > greeting.txt\necho done",
    );
    let set = fleet.run(&program, &["--timeout", "20s"], &["hello", "big world"]);
    assert!(set.starts_with("s-"));
    let polled = testkit::ok(
        fleet
            .coord
            .command()
            .args(["status", "--set", &set, "--poll", "--json"]),
    );
    let row = serde_json::from_str::<Value>(&polled).unwrap()[0].clone();
    assert_eq!(row["state"], "finished", "{row:#}");
    assert_eq!(row["outcome"]["exit_code"], 0);
    assert_events_once(&row);

    let sleeper = script(&fleet.path("sleepy.sh"), "sleep 30");
    let slow = fleet.run(&sleeper, &["--timeout", "1s"], &[]);
    let row2 = fleet.wait_row(&slow, is_final);
    assert_eq!(row2["outcome"]["timed_out"], true, "{row2:#}");

    // The human table shows both rows.
    let table = testkit::ok(fleet.coord.command().args(["status", "--set", &set]));
    assert!(
        table.lines().nth(1).unwrap().contains("finished"),
        "{table}"
    );
    let table = testkit::ok(fleet.coord.command().args(["status", "--set", &slow]));
    assert!(table.contains("timed out"), "{table}");

    let run = row["run_id"].as_str().unwrap();
    let out = fleet.path("collected.txt");
    let digest = testkit::ok(
        fleet
            .coord
            .command()
            .args(["collect", "--run", run, "--path", "greeting.txt", "--out"])
            .arg(&out),
    );
    assert_eq!(
        std::fs::read_to_string(&out).unwrap(),
        "args: hello big world\n"
    );
    let oracle = testkit::ok(std::process::Command::new("sha256sum").arg(&out));
    assert_eq!(
        digest.trim(),
        format!("sha256:{}", oracle.split_whitespace().next().unwrap())
    );

    // Bad input gets one clear line, and the agent goes on serving.
    let last = fleet.coord.refusal(&[
        "collect",
        "--run",
        run,
        "--path",
        "../../../etc/passwd",
        "--out",
        out.to_str().unwrap(),
    ]);
    // One line naming the run and the escape; the rest of the wording is the runtime's.
    assert!(
        last.starts_with(&format!("fleet-coordinator: run {run}: "))
            && last.contains("leaves the run folder"),
        "{last}"
    );
    assert_eq!(
        fleet.coord.refusal(&[
            "run",
            "--node",
            "nobody",
            "--program",
            program.to_str().unwrap()
        ]),
        "fleet-coordinator: no node matches nobody: see `fleet-coordinator nodes`"
    );
    assert_eq!(
        fleet.coord.refusal(&["status", "--set", "s-000000000000"]),
        "fleet-coordinator: no set s-000000000000: it never existed or was pruned"
    );
    let again = testkit::ok(
        fleet
            .coord
            .command()
            .args(["run", "--node", "worker", "--program"])
            .arg(&program)
            .args(["--", "again"]),
    );
    assert_eq!(fleet.wait_row(again.trim(), is_final)["state"], "finished");
}

#[test]
fn a_stopped_coordinator_misses_no_event_and_stores_none_twice() {
    let mut fleet = Fleet::new();
    let (marker, program) = fleet.effect_program("work.sh", "sleep 1");
    let sets: Vec<String> = (0..5)
        .map(|i| fleet.run(&program, &[], &[&format!("run-{i}")]))
        .collect();
    let runs: Vec<String> = sets
        .iter()
        .map(|set| {
            let row = fleet.wait_row(set, |r| r["state"] != "waiting");
            row["run_id"].as_str().unwrap().to_string()
        })
        .collect();
    fleet.coord.kill();
    // The runs finish while nobody listens; their events wait in the agent's spool.
    assert!(wait_until(WAIT, || std::fs::read_to_string(&marker)
        .unwrap_or_default()
        .lines()
        .count()
        == 5));
    assert!(
        wait_until(WAIT, || runs.iter().all(|run| fleet.ended_in_store(run))),
        "not every run's result reached the run store"
    );
    fleet.coord.restart();
    for set in &sets {
        let row = fleet.wait_row(set, is_final);
        assert_eq!(row["state"], "finished", "{row:#}");
        assert_events_once(&row);
    }
    let agent = fleet.agent.as_ref().unwrap();
    assert!(agent.count("session lost") >= 1);
    fleet.kill_agent();
}

#[test]
fn a_killed_supervisor_shows_lost() {
    let fleet = Fleet::new();
    let (token, set, run) = fleet.run_sleeper("sleeper");
    let supervisors = processes_with(&["fleet-run-supervisor", &run]);
    assert!(!supervisors.is_empty(), "no supervisor process for {run}");
    let killed = Instant::now();
    for pid in &supervisors {
        kill9(*pid);
    }
    let lost = fleet.wait_row(&set, is_final);
    assert_eq!(lost["state"], "lost", "{lost:#}");
    eprintln!(
        "lost {:.2} s after the kill (heartbeat 200 ms)",
        killed.elapsed().as_secs_f64()
    );
    for pid in processes_with(&[&token]) {
        kill9(pid);
    }
}

#[test]
fn a_stopped_run_ends_finished_and_says_it_was_stopped() {
    let fleet = Fleet::new();
    let (token, set, run) = fleet.run_sleeper("stoppable");
    let begun = Instant::now();
    let out = testkit::ok(fleet.coord.command().args(["stop", "--run", &run]));
    assert_eq!(out.trim(), format!("stopped {run}"));
    let row = fleet.wait_row(&set, is_final);
    eprintln!(
        "final {:.2} s after the stop",
        begun.elapsed().as_secs_f64()
    );
    // The stop ended it, not the program's own 60 s.
    assert_eq!(row["state"], "finished", "{row:#}");
    assert_eq!(row["outcome"]["stopped"], true, "{row:#}");
    assert_events_once(&row);
    assert!(
        processes_with(&[&token]).is_empty(),
        "the program outlived its stop"
    );
    let table = testkit::ok(fleet.coord.command().args(["status", "--run", &run]));
    assert!(table.contains(" stopped "), "{table}");
    assert_eq!(
        fleet.coord.refusal(&["stop", "--run", &run]),
        format!("fleet-coordinator: run {run} already ended (finished): there is nothing to stop")
    );
    assert_eq!(
        fleet.coord.refusal(&["stop", "--run", "r-000000000000"]),
        "fleet-coordinator: no run r-000000000000: it never existed or was pruned"
    );
}

/// Pids whose command line holds every needle (ours only: the test started them).
fn processes_with(needles: &[&str]) -> Vec<i32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if needles.iter().all(|n| cmdline.contains(n)) {
            out.push(pid);
        }
    }
    out
}

fn kill9(pid: i32) {
    let _ = std::process::Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status();
}

#[test]
fn crash_loop_every_run_executes_once_and_reports_once() {
    let mut fleet = Fleet::new();
    let (effects, program) = fleet.effect_program("once.sh", "true");
    const RUNS: usize = 200;
    let mut sets = Vec::new();
    let mut kills = 0;
    let mut rng = Lcg(std::process::id() as u64);
    let started = Instant::now();
    while sets.len() < RUNS {
        for _ in 0..8 {
            sets.push(fleet.run(&program, &[], &[&format!("token-{}", sets.len())]));
        }
        // SIGKILL the agent at a random moment while these are in flight, then start it again.
        std::thread::sleep(Duration::from_millis(rng.below(150)));
        fleet.kill_agent();
        kills += 1;
        fleet.start_agent();
    }
    // Keep killing until everything is final.
    let mut rows = Vec::new();
    let done = wait_until(Duration::from_secs(120), || {
        if rng.below(4) == 0 {
            // A random moment for the SIGKILL, not a wait.
            std::thread::sleep(Duration::from_millis(rng.below(200)));
            fleet.kill_agent();
            kills += 1;
            fleet.start_agent();
        }
        rows = sets.iter().map(|s| fleet.row(s)).collect();
        rows.iter().all(is_final)
    });
    assert!(
        done,
        "not all runs ended: {:#}",
        json!(rows.iter().filter(|r| !is_final(r)).collect::<Vec<_>>())
    );
    let text = std::fs::read_to_string(&effects).unwrap();
    let mut seen = std::collections::HashMap::new();
    for line in text.lines() {
        *seen.entry(line.to_string()).or_insert(0) += 1;
    }
    for i in 0..RUNS {
        assert_eq!(
            seen.get(&format!("token-{i}")),
            Some(&1),
            "run {i} executed {:?} times",
            seen.get(&format!("token-{i}"))
        );
    }
    for row in &rows {
        assert_eq!(row["state"], "finished", "{row:#}");
        assert_events_once(row);
    }
    assert!(kills >= 25, "only {kills} kills");
    eprintln!(
        "{RUNS} runs, {kills} SIGKILLs, {:.1} s",
        started.elapsed().as_secs_f64()
    );
}

#[test]
fn a_start_cut_off_between_its_record_and_its_launch_is_completed_once_at_the_restart() {
    // The test build's hook holds the start right after its durable `starting` record, once.
    let marker_dir = testkit::tempdir();
    let marker = marker_dir.path().join("held");
    let mut fleet = Fleet::with_agent_env(vec![(
        "FLEET_AGENT_HOLD_AT".into(),
        format!("run-recorded:{}", marker.display()),
    )]);
    let (effects, program) = fleet.effect_program("once.sh", "true");
    let set = fleet.run(&program, &[], &["cut-1"]);
    // The coordinator has taken the `starting` event, so it will not send this start again.
    let row = fleet.wait_row(&set, |r| r["state"] == "starting");
    assert!(marker.exists(), "{row:#}");
    fleet.kill_agent();
    assert!(!effects.exists(), "nothing ran before the kill");
    let restarted = Instant::now();
    fleet.start_joined_agent();
    let row = fleet.wait_row(&set, is_final);
    eprintln!(
        "resolved {:.2} s after the restart",
        restarted.elapsed().as_secs_f64()
    );
    assert_eq!(row["state"], "finished", "{row:#}");
    assert_events_once(&row);
    assert_eq!(std::fs::read_to_string(&effects).unwrap(), "cut-1\n");
    let log = fleet.agent.as_ref().unwrap().log_text();
    assert!(
        log.contains("completing a start the agent recorded but did not launch"),
        "{log}"
    );
}

/// A small deterministic generator seeded per run, so no extra dependency is needed.
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

/// The node's command handling with the real store and the real supervisor, command by command.
mod node_commands {
    use crate::as_run_id;
    use fleet_agent::node::Node;
    use fleet_agent::runtime::ProcessRuntime;
    use fleet_proto::protocol::{Answer, Command, RefusalClass, Reply, StartRun};
    use fleet_proto::run::{RunOptions, Workload};
    use fleet_proto::{Bytes, Digest};
    use std::sync::Arc;

    fn node(dir: &std::path::Path) -> Node {
        let runtime = ProcessRuntime::new(testkit::bin("fleet-run-supervisor"), dir.join("runs"));
        Node::open(&dir.join("state"), Arc::new(runtime)).unwrap()
    }

    fn start(run_id: &str, program: &Digest) -> Command {
        Command::Start(StartRun {
            run_id: fleet_proto::RunId::parse(run_id).unwrap(),
            workload: Workload::Program(*program),
            registry_auth: None,
            options: RunOptions {
                argv: vec![Bytes(b"x".to_vec())],
                timeout_ms: Some(10_000),
                ..RunOptions::default()
            },
        })
    }

    /// A stage of `bytes`, put into the node's content store first (what a fetch leaves there).
    fn stage(dir: &std::path::Path, bytes: &[u8]) -> (Digest, Command) {
        let digest = Digest::parse(&format!("sha256:{}", sha256_hex(bytes))).unwrap();
        let file = dir.join("program");
        std::fs::write(&file, bytes).unwrap();
        let held = fleet_agent::node::content_blobs(&dir.join("state"));
        assert_eq!(held.import(&file).unwrap().0, digest);
        let command = Command::Stage { digest };
        (digest, command)
    }

    fn sha256_hex(bytes: &[u8]) -> String {
        let dir = testkit::tempdir();
        let file = dir.path().join("f");
        std::fs::write(&file, bytes).unwrap();
        let out = testkit::ok(std::process::Command::new("sha256sum").arg(&file));
        out.split_whitespace().next().unwrap().to_string()
    }

    fn error(answer: &Answer) -> &str {
        match answer {
            Err(refusal) => &refusal.message,
            Ok(reply) => panic!("not a refusal: {reply:?}"),
        }
    }

    #[test]
    fn content_no_run_record_refers_to_is_pruned_after_its_grace() {
        use fleet_proto::run::{RunReport, RunState};
        use std::time::Duration;
        let dir = testkit::tempdir();
        let node = node(dir.path());
        let held = fleet_agent::node::content_blobs(&dir.path().join("state"));
        let import = |name: &str| {
            let file = dir.path().join(name);
            std::fs::write(&file, name).unwrap();
            held.import(&file).unwrap().0
        };
        let (program, input, staged_only) = (import("program"), import("input"), import("staged"));
        // A run's record refers to its program and its inputs; a stage no run followed, to none.
        let record = |run: &str| {
            let workload = Workload::Program(program);
            node.store()
                .track_run_with(&as_run_id(run), &workload, std::slice::from_ref(&input))
                .unwrap();
            node.store()
                .transition(&as_run_id(run), RunState::Finished, RunReport::default())
                .unwrap();
        };
        record("r-old");
        assert_eq!(
            node.prune_content(Duration::from_secs(3600)).unwrap(),
            [],
            "within its grace all content stays"
        );
        assert_eq!(node.prune_content(Duration::ZERO).unwrap(), [staged_only]);
        assert!(
            held.has(&program) && held.has(&input),
            "a run's content stays"
        );
        // Once retention forgets the run's record, its content goes too.
        let workload =
            Workload::Program(Digest::parse(&format!("sha256:{}", "0".repeat(64))).unwrap());
        for n in 0..fleet_agent::state::KEEP_FINAL_RUNS {
            let run = format!("r-{n}");
            node.store().track_run(&as_run_id(&run), &workload).unwrap();
            node.store()
                .transition(&as_run_id(&run), RunState::Finished, RunReport::default())
                .unwrap();
        }
        assert_eq!(
            node.store().run(&as_run_id("r-old")).unwrap(),
            None,
            "retention forgot it"
        );
        let mut removed = node.prune_content(Duration::ZERO).unwrap();
        removed.sort_by_key(|d| d.to_string());
        let mut expected = vec![program, input];
        expected.sort_by_key(|d| d.to_string());
        assert_eq!(removed, expected);
        assert!(held.list().unwrap().is_empty(), "no content left");
    }

    #[test]
    fn bad_commands_get_clear_errors_and_redeliveries_are_answered_from_the_record() {
        let dir = testkit::tempdir();
        let node = Arc::new(node(dir.path()));
        // The node answers on an async task, its work on the blocking pool, as in a session.
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let execute = |op, generation, command: &Command| {
            runtime.block_on(node.execute(op, generation, command))
        };
        let counter = dir.path().join("count");
        let program = format!("#!/bin/sh\necho run >> {}\n", counter.display());
        let (digest, stage_cmd) = stage(dir.path(), program.as_bytes());
        assert_eq!(
            execute("stage-1", 1, &stage_cmd),
            Ok(Reply::Staged { digest })
        );

        let first = execute("start-a", 1, &start("r-a", &digest));
        assert_eq!(
            first,
            Ok(Reply::Started {
                run_id: fleet_proto::RunId::parse("r-a").unwrap(),
                already: false
            })
        );
        // Redelivered: the same answer, from the record; nothing launched again.
        assert_eq!(execute("start-a", 1, &start("r-a", &digest)), first);
        // Another operation reusing the run id is a duplicate.
        assert_eq!(
            error(&execute("start-b", 1, &start("r-a", &digest))),
            "run r-a: the run id is already used on this node; start it under a new run id"
        );
        // An unknown program digest.
        let unknown = Digest::parse(&format!("sha256:{}", "0".repeat(64))).unwrap();
        let unstaged = execute("start-c", 1, &start("r-c", &unknown));
        assert_eq!(
            error(&unstaged),
            format!(
                "run r-c: content {unknown}: this node holds no copy and has no content path to a coordinator"
            ),
        );
        assert_eq!(unstaged.unwrap_err().class, RefusalClass::NotStaged);
        // A collect path that escapes the run folder.
        let collect = Command::Collect {
            run_id: fleet_proto::RunId::parse("r-a").unwrap(),
            path: "../r-c/x".into(),
            upload: "u".into(),
            max_bytes: None,
        };
        let escaped = execute("collect-1", 1, &collect);
        assert!(
            error(&escaped).starts_with("run r-a: ")
                && error(&escaped).contains("leaves the run folder"),
            "{escaped:?}"
        );
        assert_eq!(escaped.unwrap_err().class, RefusalClass::PathEscapes);
        // A command from a superseded session generation.
        assert!(execute("start-d", 3, &start("r-d", &digest)).is_ok());
        assert_eq!(
            error(&execute("start-e", 2, &start("r-e", &digest))),
            "command from session generation 2 refused: generation 3 superseded it; reconnect to get a current session"
        );
        // The node keeps serving: r-a and r-d ran, once each. With both results in the run
        // store, their programs are done: no line can come later.
        let ended = |run: &str| {
            dir.path()
                .join("runs/runs")
                .join(run)
                .join("result.json")
                .exists()
        };
        assert!(
            testkit::agent::wait_until(super::WAIT, || ended("r-a") && ended("r-d")),
            "r-a and r-d never ended"
        );
        assert_eq!(
            std::fs::read_to_string(&counter).unwrap(),
            "run\nrun\n",
            "r-a and r-d ran once each"
        );
        // Every state change is spooled once, with increasing ids.
        let events = node.store().pending_events(0, 100).unwrap();
        let ids: Vec<u64> = events.iter().map(|e| e.id).collect();
        assert!(ids.windows(2).all(|w| w[0] < w[1]), "{ids:?}");
        let c_failed = events
            .iter()
            .filter(|e| e.run_id == "r-c" && e.state.as_str() == "failed")
            .count();
        assert_eq!(c_failed, 1);
    }
}

#[test]
fn a_run_nobody_takes_fails_and_a_run_on_a_lost_machine_is_lost() {
    let mut fleet = Fleet::new();
    let program = script(&fleet.path("long.sh"), "sleep 30");
    let set = fleet.run(&program, &[], &["lost-machine"]);
    fleet.wait_row(&set, |r| r["state"] == "running");
    // The machine goes away mid-run: after its lease (2 s) the row is lost, final, not a hang.
    fleet.kill_agent();
    let row = fleet.wait_row(&set, is_final);
    assert_eq!(row["state"], "lost", "{row:#}");
    let node = row["node_id"].as_str().unwrap();
    assert_eq!(
        row["error"],
        format!("node {node} stopped answering while the run was running")
    );
    for pid in processes_with(&["lost-machine"]) {
        kill9(pid);
    }
    // A coordinator whose waiting timeout is short fails a run nobody takes.
    fleet.coord = Coordinator::start(&fleet.path("coord2"), &["--waiting-timeout", "1s"]);
    std::fs::write(fleet.path("fleet.json"), fleet.coord.token(&[])).unwrap();
    let _ = std::fs::remove_dir_all(fleet.path("state"));
    fleet.start_joined_agent();
    fleet.kill_agent();
    let set = fleet.run(&program, &[], &[]);
    let row = fleet.wait_row(&set, is_final);
    assert_eq!(row["state"], "failed", "{row:#}");
    assert_eq!(
        row["error"],
        format!(
            "node {} did not take the run within 1 s",
            row["node_id"].as_str().unwrap()
        )
    );
}

#[test]
fn an_unreadable_node_store_stops_the_agent_naming_the_file() {
    let mut fleet = Fleet::new();
    fleet.kill_agent();
    let store = fleet.path("state").join("agent.redb");
    std::fs::write(
        &store,
        b"not a redb file at all, and long enough to be read as one",
    )
    .unwrap();
    fleet.start_agent();
    let agent = fleet.agent.as_mut().unwrap();
    let status = agent.wait_exit(WAIT).expect("the agent stops");
    assert_eq!(status.code(), Some(1));
    let last = agent
        .log_text()
        .lines()
        .last()
        .unwrap_or_default()
        .to_string();
    assert!(
        last.starts_with(&format!(
            "fleet-agent: agent state {} cannot be read: ",
            store.display()
        )) && last.ends_with(
            "restore it or move it aside deliberately, the agent never starts over on its own"
        ),
        "{last}"
    );
    assert_eq!(
        std::fs::read(&store).unwrap(),
        b"not a redb file at all, and long enough to be read as one"
    );
}

#[test]
fn an_input_too_large_for_the_disk_fails_its_row_and_the_agent_goes_on() {
    let mut fleet = Fleet::new();
    fleet.kill_agent();
    // The run store on a 1 MiB memory filesystem (we are root on the test machine).
    let runs = fleet.path("runs");
    std::fs::create_dir_all(&runs).unwrap();
    let _mount = testkit::TinyDisk::mount(runs.clone(), "1m");
    fleet.start_joined_agent();
    let big = fleet.path("big.bin");
    std::fs::write(&big, vec![7u8; 3 << 20]).unwrap();
    let program = script(&fleet.path("read.sh"), "ls -l");
    let input = format!("big={}", big.display());
    let set = fleet.run(&program, &["--input", &input], &[]);
    let row = fleet.wait_row(&set, is_final);
    assert_eq!(row["state"], "failed", "{row:#}");
    let error = row["error"].as_str().unwrap_or_default();
    assert!(
        error.starts_with(&format!("run {}: ", row["run_id"].as_str().unwrap())),
        "{error}"
    );
    assert!(
        error.contains("full") || error.contains("No space left"),
        "{error}"
    );
    // Freeing the space, as the message says, and the same agent serves the next run.
    let _ = std::fs::remove_dir_all(runs.join("runs").join(row["run_id"].as_str().unwrap()));
    let next = fleet.run(&program, &[], &[]);
    let next = fleet.wait_row(&next, is_final);
    assert_eq!(next["state"], "finished", "{next:#}");
    fleet.kill_agent();
}

#[test]
fn a_malformed_command_fails_its_row_and_the_agent_goes_on() {
    let fleet = Fleet::new();
    let effects = fleet.path("effects");
    let program = script(
        &fleet.path("mark.sh"),
        &format!("echo ran >> {}", effects.display()),
    );
    let sum = testkit::ok(std::process::Command::new("sha256sum").arg(&program));
    let digest = format!("sha256:{}", sum.split_whitespace().next().unwrap());
    // What a coordinator of a newer protocol version could send: a kind this agent does not know,
    // a start whose timeout has another type (serde names the value and the type it expected),
    // and a start in an older shape (a bare program where a workload belongs).
    let unknown = json!({ "kind": "launch_missiles", "target": "moon" });
    let skewed = json!({ "kind": "start", "run_id": "r-skewed", "workload": { "program": digest }, "timeout_ms": "20s" });
    let renamed = json!({ "kind": "start", "run_id": "r-renamed", "program": digest });
    let cases = [
        (
            unknown,
            "a malformed command: unknown variant `launch_missiles`, expected one of `stage`, `start`, `stop`, `status`, `collect`, `facts`, `replicate`, `update`, `check`",
        ),
        (
            skewed,
            "a malformed command: invalid type: string \"20s\", expected u64",
        ),
        (renamed, "a malformed command: missing field `workload`"),
    ];
    for (command, error) in cases {
        let set = fleet.run(&program, &["--raw-command", &command.to_string()], &[]);
        let row = fleet.wait_row(&set, is_final);
        assert_eq!(row["state"], "failed", "{row:#}");
        assert_eq!(row["error"], error, "{row:#}");
        // Nothing ran for it: no event, no run folder on the node.
        assert_eq!(row["events"], json!([]), "{row:#}");
        let run = row["run_id"].as_str().unwrap();
        assert!(!fleet.path("runs").join("runs").join(run).exists());
    }
    for run in ["r-skewed", "r-renamed"] {
        assert!(!fleet.path("runs").join("runs").join(run).exists());
    }
    assert!(!effects.exists(), "a malformed command ran the program");
    // The same agent, in the same session, serves the next run.
    let next = fleet.run(&program, &[], &[]);
    let next = fleet.wait_row(&next, is_final);
    assert_eq!(next["state"], "finished", "{next:#}");
    assert_eq!(std::fs::read_to_string(&effects).unwrap(), "ran\n");
    let agent = fleet.agent.as_ref().unwrap();
    assert_eq!(
        agent.count("a malformed command"),
        3,
        "{}",
        agent.log_text()
    );
    assert_eq!(agent.count("session open"), 1, "{}", agent.log_text());
}

#[test]
fn a_stop_that_waits_out_a_long_grace_keeps_the_node_joined() {
    // The program ignores SIGTERM, so the stop waits out the supervisor's whole grace (10 s),
    // five times the coordinator's lease (2 s): heartbeats must go on meanwhile.
    let fleet = Fleet::new();
    let program = script(
        &fleet.path("stubborn.sh"),
        "trap '' TERM\nsleep 60 & wait; sleep 60",
    );
    let set = fleet.run(&program, &[], &[]);
    let row = fleet.wait_row(&set, |r| r["state"] == "running");
    let run = row["run_id"].as_str().unwrap().to_string();
    let stopping = std::thread::spawn({
        let mut stop = fleet.coord.command();
        stop.args(["stop", "--run", &run]);
        move || testkit::ok(&mut stop)
    });
    let begun = Instant::now();
    // When the last check that found the node joined was made, into the stop.
    let mut last_joined = Duration::ZERO;
    while !stopping.is_finished() {
        let asked = begun.elapsed();
        let nodes = fleet.coord.nodes();
        assert_eq!(
            nodes[0]["state"], "Joined",
            "the node was dropped during a stop: {nodes:#?}"
        );
        last_joined = asked;
        // Pacing between checks, not a wait.
        std::thread::sleep(Duration::from_millis(500));
        assert!(begun.elapsed() < WAIT, "the stop never returned");
    }
    assert_eq!(stopping.join().unwrap().trim(), format!("stopped {run}"));
    assert!(
        begun.elapsed() >= Duration::from_secs(9),
        "{:?}",
        begun.elapsed()
    );
    // Seen joined two leases into the stop: heartbeats went on while it waited.
    assert!(
        last_joined >= Duration::from_secs(4),
        "the node was last checked {last_joined:?} into a stop of {:?}",
        begun.elapsed()
    );
    let row = fleet.wait_row(&set, is_final);
    assert_eq!(row["outcome"]["stopped"], true, "{row:#}");
    let agent = fleet.agent.as_ref().unwrap();
    assert_eq!(agent.count("session lost"), 0, "{}", agent.log_text());
}

/// A machine whose wall clock is two hours off joins, keeps its sessions and runs work: expiry
/// and session lengths are judged on the coordinator's clock, the node only measures durations.
fn a_machine_with_its_clock_off_joins_and_works(offset: &str) -> Fleet {
    // Short session credentials, so the test sees sessions renewed under the skewed clock too.
    let fleet = Fleet::with_agent(clock_offset(offset), &["--session-validity", "3s"]);
    let (effects, program) = fleet.effect_program("mark.sh", "true");
    let set = fleet.run(&program, &[], &["skewed"]);
    let row = fleet.wait_row(&set, is_final);
    assert_eq!(row["state"], "finished", "{row:#}");
    assert_eq!(std::fs::read_to_string(&effects).unwrap(), "skewed\n");
    // The agent's wall clock really was off.
    let started_at = row["outcome"]["started_at"].as_str().unwrap().to_string();
    let hour: u32 = started_at[11..13].parse().unwrap();
    let now_hour: u32 = testkit::ok(std::process::Command::new("date").args(["-u", "+%H"]))
        .trim()
        .parse()
        .unwrap();
    assert_ne!(
        hour, now_hour,
        "the faked clock did not reach the agent: {started_at}"
    );
    let agent = fleet.agent.as_ref().unwrap();
    assert!(
        agent.wait_for("session credential renewed", 2, WAIT),
        "{}",
        agent.log_text()
    );
    let nodes = fleet.coord.nodes();
    assert_eq!(nodes[0]["state"], "Joined", "{nodes:#?}");
    fleet
}

#[test]
fn a_machine_whose_clock_is_two_hours_behind_joins_and_works() {
    let fleet = a_machine_with_its_clock_off_joins_and_works("-2h");
    let agent = fleet.agent.as_ref().unwrap();
    assert_eq!(agent.count("session lost"), 0, "{}", agent.log_text());
}

#[test]
fn a_machine_whose_clock_is_two_hours_ahead_joins_works_and_names_its_clock() {
    let fleet = a_machine_with_its_clock_off_joins_and_works("+2h");
    // Its clock reads the one-hour token as expired: one warning that names this machine's
    // clock, and the join goes ahead because the coordinator's clock is the one that counts.
    let agent = fleet.agent.as_ref().unwrap();
    let log = agent.log_text();
    assert_eq!(agent.count("this machine's clock may be wrong"), 1, "{log}");
    assert!(log.contains("s past the join token's expiry by the coordinator's clock: this machine's clock may be wrong (sync it with NTP); joining anyway, the coordinator judges expiry"), "{log}");
    assert_eq!(agent.count("session lost"), 0, "{log}");
}

#[test]
fn arguments_reach_the_program_byte_for_byte() {
    use std::os::unix::ffi::OsStrExt;
    let fleet = Fleet::new();
    let out = fleet.path("args.bin");
    let program = script(
        &fleet.path("args.sh"),
        &format!("printf '%s|' \"$@\" > {}", out.display()),
    );
    let not_utf8 = std::ffi::OsStr::from_bytes(&[0xff, b'a', 0xfe]);
    let set = testkit::ok(
        fleet
            .coord
            .command()
            .args(["run", "--all", "--program"])
            .arg(&program)
            .args(["--", "two words", "'quoted' \"and\" $HOME"])
            .arg(not_utf8),
    );
    let row = fleet.wait_row(set.trim(), is_final);
    assert_eq!(row["state"], "finished", "{row:#}");
    assert_eq!(
        std::fs::read(&out).unwrap(),
        b"two words|'quoted' \"and\" $HOME|\xffa\xfe|"
    );
}

#[test]
fn a_full_disk_fails_runs_with_the_cause_and_the_agent_works_again_once_there_is_room() {
    // The agent's state and run store on one small disk (dropped after the fleet, whose agent
    // holds files on it).
    let outside = testkit::tempdir();
    let disk = testkit::TinyDisk::mount(outside.path().join("disk"), "8m");
    let fleet = Fleet::with_setup(Vec::new(), &[], |dir| {
        for name in ["state", "runs"] {
            std::fs::create_dir_all(disk.0.join(name)).unwrap();
            std::os::unix::fs::symlink(disk.0.join(name), dir.join(name)).unwrap();
        }
    });
    let (effects, program) = fleet.effect_program("effect.sh", "true");
    let before = fleet.run(&program, &[], &["before"]);
    assert_eq!(fleet.wait_row(&before, is_final)["state"], "finished");

    disk.fill("filler");
    let mut full = Vec::new();
    for word in ["full-1", "full-2"] {
        let set = fleet.run(&program, &[], &[word]);
        let row = fleet.wait_row(&set, is_final);
        assert_eq!(row["state"], "failed", "{row:#}");
        let error = row["error"].as_str().unwrap_or_default().to_string();
        // Whichever write meets the full disk first names it: the node's store or the run store,
        // both on that disk.
        let names_the_disk = ["state", "runs"]
            .iter()
            .any(|d| error.contains(&fleet.path(d).display().to_string()));
        assert!(
            error.contains("no space left on device") && names_the_disk,
            "the real cause and the disk: {error}"
        );
        assert!(!error.contains("Previous I/O error"), "{error}");
        full.push(set);
    }
    let agent = fleet.agent.as_ref().unwrap();
    let log = agent.log_text();
    assert!(
        log.lines().any(|l| l.contains("WARN")
            && l.contains("a run could not start")
            && l.contains("no space left on device")),
        "a warning in the agent's log: {log}"
    );

    std::fs::remove_file(disk.0.join("filler")).unwrap();
    let after = fleet.run(&program, &[], &["after"]);
    let row = fleet.wait_row(&after, is_final);
    assert_eq!(row["state"], "finished", "{row:#}");
    assert_eq!(fleet.starts, 1, "no restart");
    assert_eq!(
        std::fs::read_to_string(&effects).unwrap(),
        "before\nafter\n",
        "each run that started ran once; the refused ones never ran"
    );
    // Everything recorded before is still there.
    assert_eq!(fleet.row(&before)["state"], "finished");
    for set in &full {
        assert_eq!(fleet.row(set)["state"], "failed");
    }
}

/// A run id the test names.
fn as_run_id(s: &str) -> fleet_proto::RunId {
    fleet_proto::RunId::parse(s).unwrap()
}
