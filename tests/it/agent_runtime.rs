//! Tests: agent_runtime — the node's durable store under SIGKILL, and the process runtime and its
//! watcher against the real `fleet-run-supervisor`.
use fleet_agent::runtime::{
    ProcessRuntime, Resources, RunReport, RunSpec, RunState, Runtime, RuntimeError, Started,
    Workload, sync_runs,
};
use fleet_agent::state::{Event, Store};
use fleet_proto::Digest;
use serde_json::json;
use std::collections::{BTreeMap, HashSet};
use std::io::{BufRead, BufReader, Write as _};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;
use testkit::runtime_suite::{self as suite, sha256sum, shell, wait_for};

// ---------------------------------------------------------------------------------------------
// The store under SIGKILL: a writer child process is killed at random points, again and again.

/// Set in the writer child: the state directory to work in.
const WRITER_DIR: &str = "AGENT_RUNTIME_WRITER_DIR";
/// Set in the writer child: the first operation to apply.
const WRITER_FIRST: &str = "AGENT_RUNTIME_WRITER_FIRST";
fn zero_program() -> Workload {
    Workload::Program(Digest::parse(&format!("sha256:{}", "0".repeat(64))).unwrap())
}

/// One command as a node applies it: answered from the record when already applied; otherwise its
/// run is tracked, moved through its states, and the result recorded before it is "reported".
fn apply(store: &Store, n: u64, report: &mut impl std::io::Write) {
    let op = format!("op-{n}");
    let run = format!("run-{n}");
    if let Some(result) = store.applied::<serde_json::Value>(&op).unwrap() {
        writeln!(report, "answered {n} {result}").unwrap();
        return;
    }
    store.track_run(&as_run_id(&run), &zero_program()).unwrap();
    store
        .transition(&as_run_id(&run), RunState::Running, RunReport::default())
        .unwrap();
    store
        .transition(
            &as_run_id(&run),
            RunState::Finished,
            RunReport::error(n.to_string()),
        )
        .unwrap();
    store.record_applied(&op, &json!({ "run": run })).unwrap();
    writeln!(report, "reported {n}").unwrap();
}

/// The writer: in the crash test's child (env set) it applies operations until it is killed; run
/// on its own it applies a few and checks each was recorded before it was reported.
#[test]
fn writer_records_each_operation_before_reporting_it() {
    if let Ok(dir) = std::env::var(WRITER_DIR) {
        let first: u64 = std::env::var(WRITER_FIRST).unwrap().parse().unwrap();
        let store = Store::open(Path::new(&dir)).unwrap();
        let mut out = std::io::stdout();
        writeln!(out, "ready").unwrap();
        // Bounded, so a parent that never kills it cannot leave it running forever.
        for n in first..first + 5_000 {
            apply(&store, n, &mut out);
        }
        return;
    }
    let dir = testkit::tempdir();
    let store = Store::open(dir.path()).unwrap();
    let mut report = Vec::new();
    for n in 0..5 {
        apply(&store, n, &mut report);
    }
    apply(&store, 3, &mut report);
    let report = String::from_utf8(report).unwrap();
    assert_eq!(
        report,
        "reported 0\nreported 1\nreported 2\nreported 3\nreported 4\nanswered 3 {\"run\":\"run-3\"}\n"
    );
    assert_eq!(store.pending_events(0, 100).unwrap().len(), 15);
}

/// A small deterministic generator, so a failing kill schedule can be replayed from its seed.
struct XorShift(u64);
impl XorShift {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

#[test]
fn sigkill_at_random_points_never_loses_a_report_or_spools_a_transition_twice() {
    let dir = testkit::tempdir();
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1;
    let mut rng = XorShift(seed);
    let mut reported: BTreeMap<u64, u32> = BTreeMap::new();
    let mut answered = 0;
    let mut next = 0;
    // What the "coordinator" (this test) received: ids and (run, state) pairs, each exactly once.
    let mut delivered: HashSet<(String, RunState)> = HashSet::new();
    let mut last_id = 0;
    let kills = 60;
    for kill in 0..kills {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "writer_records_each_operation_before_reporting_it",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(WRITER_DIR, dir.path())
            .env(WRITER_FIRST, next.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        // Wait until the writer works, then let it run a random while (0 to 60 ms) and kill it.
        // (libtest prints the test's name without a newline first, so "ready" ends that line.)
        for line in lines.by_ref() {
            if line.unwrap().ends_with("ready") {
                break;
            }
        }
        std::thread::sleep(Duration::from_micros(rng.below(60_000)));
        child.kill().unwrap();
        child.wait().unwrap();
        for line in lines {
            let line = line.unwrap();
            let mut words = line.splitn(3, ' ');
            match (words.next(), words.next()) {
                (Some("reported"), Some(n)) => {
                    *reported.entry(n.parse().unwrap()).or_default() += 1;
                }
                (Some("answered"), Some(n)) => {
                    answered += 1;
                    let n: u64 = n.parse().unwrap();
                    assert_eq!(
                        words.next(),
                        Some(format!("{{\"run\":\"run-{n}\"}}").as_str())
                    );
                    *reported.entry(n).or_default() += 1;
                }
                _ => {}
            }
        }
        // The child is dead: reopen the store as a restarted agent would, and check it.
        let store =
            Store::open(dir.path()).unwrap_or_else(|e| panic!("seed {seed}, kill {kill}: {e}"));
        for n in reported.keys() {
            assert_eq!(
                store.applied(&format!("op-{n}")).unwrap(),
                Some(json!({ "run": format!("run-{n}") })),
                "seed {seed}: op-{n} was reported but not recorded"
            );
        }
        let events = store.pending_events(last_id, usize::MAX).unwrap();
        for Event {
            id, run_id, state, ..
        } in &events
        {
            assert!(*id > last_id, "seed {seed}: event id {id} after {last_id}");
            last_id = *id;
            assert!(
                delivered.insert((run_id.to_string(), *state)),
                "seed {seed}: {run_id} {state} spooled twice"
            );
        }
        store.ack_events(last_id).unwrap();
        assert_eq!(
            store.last_event_id().unwrap(),
            last_id,
            "seed {seed}: an id was lost"
        );
        // Redeliver the first operation that was not reported: it may have been applied already.
        next = reported.keys().next_back().map_or(0, |n| n + 1);
    }
    // Finish the last operation that may be half done, as a last restart would.
    let store = Store::open(dir.path()).unwrap();
    let mut tail = Vec::new();
    apply(&store, next, &mut tail);
    for event in store.pending_events(last_id, usize::MAX).unwrap() {
        assert!(
            delivered.insert((event.run_id.to_string(), event.state)),
            "seed {seed}"
        );
    }
    let ops = next + 1;
    assert!(
        ops >= 10,
        "seed {seed}: only {ops} operations in {kills} kills"
    );
    // Every operation produced its three transitions exactly once, and none was lost.
    assert_eq!(delivered.len() as u64, 3 * ops, "seed {seed}");
    for n in 0..ops {
        for state in [RunState::Starting, RunState::Running, RunState::Finished] {
            assert!(
                delivered.contains(&(format!("run-{n}"), state)),
                "seed {seed}: run-{n} {state} never spooled"
            );
        }
    }
    eprintln!("{kills} kills, {ops} operations, {answered} answered from the record (seed {seed})");
    // A redelivery answered from the record counts as the (duplicate) acknowledgement it is.
    assert!(
        reported.values().all(|&c| c <= 2),
        "seed {seed}: {reported:?} ({answered} answered)"
    );
}

// ---------------------------------------------------------------------------------------------
// The process runtime and the watcher against the real supervisor.

fn runtime(root: &Path) -> ProcessRuntime {
    ProcessRuntime::new(testkit::bin("fleet-run-supervisor"), root)
}

#[test]
fn a_program_file_named_like_a_flag_stages_and_a_run_of_it_stops() {
    let dir = testkit::tempdir();
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    std::fs::copy("/bin/sh", work.join("-x")).unwrap();
    // The supervisor runs in `work`, so the relative name `-x` is that file.
    let supervisor = testkit::agent::script(
        &dir.path().join("supervisor-in-work"),
        &format!(
            "cd {} && exec {} \"$@\"",
            work.display(),
            testkit::bin("fleet-run-supervisor").display()
        ),
    );
    let rt = ProcessRuntime::new(supervisor, dir.path().join("runs"));
    let program = rt.stage(Path::new("-x")).unwrap();
    assert_eq!(program.to_string(), sha256sum(Path::new("/bin/sh")));
    let run = shell("dash-x", &Workload::Program(program), "sleep 600");
    assert_eq!(rt.start(&run).unwrap(), Started::New);
    rt.stop(&testkit::rid("dash-x")).unwrap();
    let status = rt.status(&testkit::rid("dash-x")).unwrap();
    assert!(status.state.is_final(), "{}", status.state);
    let outcome = status.report.outcome.unwrap();
    assert!(outcome.stopped, "{outcome:?}");
}

#[test]
fn the_process_runtime_passes_the_runtime_suite() {
    let dir = testkit::tempdir();
    let rt = runtime(&dir.path().join("runs"));
    let program = rt.stage(Path::new("/bin/sh")).unwrap();
    assert_eq!(program.to_string(), sha256sum(Path::new("/bin/sh")));
    let subject = suite::Subject {
        runtime: &rt,
        shell: Workload::Program(program),
        name: "process",
        argv_bytes: true,
    };
    let err = suite::run_all(
        &subject,
        Resources {
            memory_bytes: Some(64 << 20),
            ..Resources::default()
        },
    );
    assert_eq!(
        err.to_string(),
        "run suite-limits: a CPU, memory or GPU request is not supported by the process runtime; the supervisor enforces only the timeout and output limit; run it as an image"
    );
    // An image is a container runtime's workload.
    let image = format!("127.0.0.1:5000/app@sha256:{}", "a".repeat(64));
    let image = Workload::Image(fleet_proto::run::ImageRef::parse(&image).unwrap());
    let err = rt.start(&shell("img", &image, "true")).unwrap_err();
    assert_eq!(
        err.to_string(),
        "run img: an image is not supported by the process runtime; run images on a node with the container runtime"
    );
}

#[test]
fn process_runtime_specifics_reach_the_detail_and_refusals_keep_their_class() {
    let dir = testkit::tempdir();
    let rt = runtime(&dir.path().join("runs"));
    let program = Workload::Program(rt.stage(Path::new("/bin/sh")).unwrap());
    let mut spec = shell("r-1", &program, "true");
    spec.output_limit = Some(4096);
    rt.start(&spec).unwrap();
    let done = wait_for(&rt, "r-1", RunState::Finished);
    // The supervisor's own record travels as opaque detail.
    assert_eq!(done.report.detail["result"]["output_limit"], 4096);
    assert!(done.report.detail["result"]["containment"].is_string());

    let unknown = Workload::Program(Digest::parse(&format!("sha256:{}", "0".repeat(64))).unwrap());
    let err = rt.start(&shell("bad-1", &unknown, "true")).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "run bad-1: program sha256:{} is not staged on this node; stage it before starting the run",
            "0".repeat(64)
        )
    );
    // The refused run is final, so the watcher reports it `failed` with the step and reason.
    let failed = rt.status(&testkit::rid("bad-1")).unwrap();
    assert_eq!(failed.state, RunState::Failed);
    assert!(failed.report.error.unwrap().starts_with("stage: "));

    let missing = ProcessRuntime::new(dir.path().join("no-such-supervisor"), dir.path());
    assert_eq!(
        missing.stage(Path::new("/bin/sh")).unwrap_err().to_string(),
        format!(
            "cannot run the supervisor {}: no such file or directory; ship fleet-run-supervisor beside fleet-agent or pass its path",
            dir.path().join("no-such-supervisor").display()
        )
    );
}

#[test]
fn an_input_too_large_for_the_disk_is_a_clear_error_its_run_fails_and_the_next_run_works() {
    let dir = testkit::tempdir();
    let disk = testkit::TinyDisk::mount(dir.path().join("disk"), "256k");
    let rt = runtime(&disk.0);
    // A small static program keeps the staged copy well inside the tiny disk.
    let program = Workload::Program(rt.stage(Path::new("/bin/true")).unwrap());
    let big = dir.path().join("big");
    std::fs::write(&big, vec![7u8; 1024 * 1024]).unwrap();
    let mut spec = RunSpec::new(testkit::rid("big"), program.clone());
    spec.inputs = vec![("data".into(), big)];
    let err = rt.start(&spec).unwrap_err();
    let reason = format!(
        "input \"data\" cannot be copied into run \"big\": no space left on device under {}; free space there or send a smaller input",
        disk.0.display()
    );
    assert!(
        matches!(&err, RuntimeError::NoSpace { detail, .. } if *detail == reason),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        format!("run big: the run store's disk is full: {reason}")
    );
    // The refused run is final and says why, so the watcher reports it once and moves on.
    let status = rt.status(&testkit::rid("big")).unwrap();
    assert_eq!(status.state, RunState::Failed);
    assert_eq!(status.report.error, Some(format!("input: {reason}")));
    // The partial copy made no lasting mess: the next run with a small input starts and ends.
    let small = dir.path().join("small");
    std::fs::write(&small, "fits\n").unwrap();
    let mut next = RunSpec::new(testkit::rid("next"), program);
    next.inputs = vec![("data".into(), small)];
    assert_eq!(rt.start(&next).unwrap(), Started::New);
    let done = wait_for(&rt, "next", RunState::Finished);
    assert_eq!(done.report.outcome.unwrap().exit_code, Some(0));
}

/// Every state spooled for each run, in order.
fn spooled(store: &Store) -> BTreeMap<String, Vec<RunState>> {
    let mut by_run: BTreeMap<String, Vec<RunState>> = BTreeMap::new();
    for e in store.pending_events(0, usize::MAX).unwrap() {
        by_run
            .entry(e.run_id.to_string())
            .or_default()
            .push(e.state);
    }
    by_run
}

#[test]
fn the_watcher_spools_each_transition_once_across_restarts_and_a_dead_supervisor_as_lost() {
    use RunState::{Finished, Lost, Running, Starting};
    let dir = testkit::tempdir();
    let state_dir = dir.path().join("state");
    let rt = runtime(&dir.path().join("runs"));
    let program = Workload::Program(rt.stage(Path::new("/bin/sh")).unwrap());
    let store = Store::open(&state_dir).unwrap();
    for (run, script) in [("short", "sleep 0.5"), ("long", "sleep 30")] {
        store.track_run(&as_run_id(run), &program).unwrap();
        rt.start(&shell(run, &program, script)).unwrap();
    }
    // Tracked, never launched (the agent died before the start): left alone, not reported lost.
    store.track_run(&as_run_id("pending"), &program).unwrap();
    let report = sync_runs(&store, &rt).unwrap();
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(report.events.len(), 2, "{:?}", report.events);

    // The long run's supervisor dies (and we end its orphaned program, which nobody watches now).
    let owner = rt.status(&testkit::rid("long")).unwrap().report.detail["owner"].clone();
    for pid in [&owner["pid"], &owner["program_pid"]] {
        testkit::ok(Command::new("kill").arg("-KILL").arg(pid.to_string()));
    }
    // The agent goes away while the short run finishes, then comes back.
    drop(store);
    wait_for(&rt, "short", Finished);
    let store = Store::open(&state_dir).unwrap();
    let report = sync_runs(&store, &rt).unwrap();
    let got: Vec<(&str, RunState)> = report
        .events
        .iter()
        .map(|e| (e.run_id.as_str(), e.state))
        .collect();
    assert_eq!(got, [("long", Lost), ("short", Finished)]);
    assert_eq!(
        report.events[1].report.outcome.as_ref().unwrap().exit_code,
        Some(0)
    );
    assert!(sync_runs(&store, &rt).unwrap().events.is_empty());
    drop(store);
    let store = Store::open(&state_dir).unwrap();
    assert!(sync_runs(&store, &rt).unwrap().events.is_empty());

    let expected: BTreeMap<String, Vec<RunState>> = [
        ("long", vec![Starting, Running, Lost]),
        ("pending", vec![Starting]),
        ("short", vec![Starting, Running, Finished]),
    ]
    .into_iter()
    .map(|(r, s)| (r.to_string(), s))
    .collect();
    assert_eq!(spooled(&store), expected);
    let ids: Vec<u64> = store
        .pending_events(0, usize::MAX)
        .unwrap()
        .iter()
        .map(|e| e.id)
        .collect();
    assert_eq!(ids, (1..=7).collect::<Vec<u64>>());
}

/// Set in the watcher child: the state directory and the run store.
const WATCH_STATE: &str = "AGENT_RUNTIME_WATCH_STATE";
const WATCH_RUNS: &str = "AGENT_RUNTIME_WATCH_RUNS";

/// The watcher as an agent runs it: in the crash test's child (env set) it syncs every few ms
/// until it is killed; run on its own it checks that a sync of nothing spools nothing.
#[test]
fn watcher_syncs_until_killed() {
    if let (Ok(state), Ok(runs)) = (std::env::var(WATCH_STATE), std::env::var(WATCH_RUNS)) {
        let store = Store::open(Path::new(&state)).unwrap();
        let rt = runtime(Path::new(&runs));
        writeln!(std::io::stdout(), "ready").unwrap();
        for _ in 0..10_000 {
            sync_runs(&store, &rt).unwrap();
            // Pacing, as the agent's watch, not a wait.
            std::thread::sleep(Duration::from_millis(2));
        }
        return;
    }
    let dir = testkit::tempdir();
    let store = Store::open(dir.path()).unwrap();
    let report = sync_runs(&store, &runtime(&dir.path().join("runs"))).unwrap();
    assert!(report.events.is_empty() && report.errors.is_empty());
}

#[test]
fn sigkill_of_the_watching_agent_at_random_points_spools_each_run_transition_once() {
    let dir = testkit::tempdir();
    let (state_dir, runs) = (dir.path().join("state"), dir.path().join("runs"));
    let rt = runtime(&runs);
    let program = Workload::Program(rt.stage(Path::new("/bin/sh")).unwrap());
    let store = Store::open(&state_dir).unwrap();
    let count = 12;
    for n in 0..count {
        let run = format!("w-{n}");
        store.track_run(&as_run_id(&run), &program).unwrap();
        let script = format!("sleep {}.{}", n / 5, (n % 5) * 2);
        rt.start(&shell(&run, &program, &script)).unwrap();
    }
    drop(store);
    let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
    let mut delivered: HashSet<(String, RunState)> = HashSet::new();
    let mut last_id = 0;
    let mut restarts = 0;
    loop {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "watcher_syncs_until_killed", "--nocapture"])
            .env(WATCH_STATE, &state_dir)
            .env(WATCH_RUNS, &runs)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        for line in lines {
            if line.unwrap().ends_with("ready") {
                break;
            }
        }
        // A random moment for the SIGKILL, not a wait.
        std::thread::sleep(Duration::from_micros(rng.below(60_000)));
        child.kill().unwrap();
        child.wait().unwrap();
        restarts += 1;
        let store = Store::open(&state_dir).unwrap();
        for e in store.pending_events(last_id, usize::MAX).unwrap() {
            assert!(e.id > last_id);
            last_id = e.id;
            assert!(
                delivered.insert((e.run_id.to_string(), e.state)),
                "{} {} spooled twice",
                e.run_id,
                e.state
            );
        }
        store.ack_events(last_id).unwrap();
        // Some restarts after the last run ended, too: they must find nothing new.
        if store.active_runs().unwrap().is_empty() && restarts >= 15 {
            break;
        }
        assert!(restarts < 200, "runs never all finished: {delivered:?}");
    }
    for n in 0..count {
        let run = format!("w-{n}");
        for state in [RunState::Starting, RunState::Finished] {
            assert!(
                delivered.contains(&(run.clone(), state)),
                "{run} {state} missing"
            );
        }
        for state in [RunState::Failed, RunState::Lost] {
            assert!(!delivered.contains(&(run.clone(), state)), "{run} {state}");
        }
    }
    eprintln!("{restarts} watcher kills, {} events", delivered.len());
}

/// A run id the test names.
fn as_run_id(s: &str) -> fleet_proto::RunId {
    fleet_proto::RunId::parse(s).unwrap()
}
