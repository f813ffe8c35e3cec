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
use std::time::{Duration, Instant};

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
    if let Some(result) = store.applied(&op).unwrap() {
        writeln!(report, "answered {n} {result}").unwrap();
        return;
    }
    store.track_run(&run, &zero_program()).unwrap();
    store
        .transition(&run, RunState::Running, RunReport::default())
        .unwrap();
    store
        .transition(&run, RunState::Finished, RunReport::error(n.to_string()))
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
                delivered.insert((run_id.clone(), *state)),
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
            delivered.insert((event.run_id.clone(), event.state)),
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

/// `sha256:HEX` of a file, by `sha256sum`: an oracle independent of our code.
fn sha256sum(path: &Path) -> String {
    let out = testkit::ok(Command::new("sha256sum").arg(path));
    format!("sha256:{}", out.split_whitespace().next().unwrap())
}

/// Polls the runtime until the run reaches `state` (or fails the test after 10 s).
fn wait_for(rt: &dyn Runtime, run: &str, state: RunState) -> fleet_agent::runtime::RunStatus {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let status = rt.status(run).unwrap();
        if status.state == state {
            return status;
        }
        assert!(
            Instant::now() < deadline,
            "run {run} stuck in {}",
            status.state
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A spec running `/bin/sh -c SCRIPT ARG...` from a workload that is a shell.
fn shell(run: &str, shell: &Workload, script: &str) -> RunSpec {
    let mut spec = RunSpec::new(run, shell.clone());
    spec.argv = vec!["-c".into(), script.into(), "sh".into()];
    spec.timeout = Some(Duration::from_secs(20));
    spec
}

/// The behaviour every runtime must show, whatever runs the work (a supervised process, a
/// container). A runtime passes by giving a runtime and a workload that is a POSIX shell.
mod suite {
    use super::*;

    pub struct Subject<'a> {
        pub runtime: &'a dyn Runtime,
        /// A workload whose program is `/bin/sh`.
        pub shell: Workload,
        /// The runtime's name in its `Unsupported` errors.
        pub name: &'static str,
    }

    /// Started once (a redelivered start launches nothing), any bytes as arguments, a typed
    /// outcome, a streamed collect with its digest, and the run listed.
    pub fn starts_once_and_collects(s: &Subject) {
        use std::os::unix::ffi::OsStringExt;
        let dir = testkit::tempdir();
        let marks = dir.path().join("marks");
        let mut spec = shell(
            "suite-1",
            &s.shell,
            r#"printf %s "$1" > out.bin; echo ran >> "$MARKS"; echo to-stderr >&2; exit 3"#,
        );
        spec.argv
            .push(std::ffi::OsString::from_vec(vec![0xff, b'a', 0xfe]));
        spec.env = vec![("MARKS".into(), marks.display().to_string())];
        assert_eq!(s.runtime.start(&spec).unwrap(), Started::New);
        let done = wait_for(s.runtime, "suite-1", RunState::Finished);
        let outcome = done.report.outcome.expect("a finished run has an outcome");
        assert_eq!((outcome.exit_code, outcome.signal), (Some(3), None));
        assert!(!outcome.timed_out && !outcome.stopped);
        let stderr = outcome.stderr.expect("stderr is accounted");
        assert_eq!(
            (stderr.bytes, stderr.last.0.as_slice()),
            (10, &b"to-stderr\n"[..])
        );
        assert!(outcome.started_at.is_some() && outcome.ended_at.is_some());
        assert_eq!(s.runtime.start(&spec).unwrap(), Started::Already);
        assert_eq!(std::fs::read_to_string(&marks).unwrap(), "ran\n");

        let mut collected = Vec::new();
        let got = s
            .runtime
            .collect("suite-1", "out.bin", 1024, &mut collected)
            .unwrap();
        assert_eq!(collected, [0xff, b'a', 0xfe]);
        assert_eq!(got.size, 3);
        let out = dir.path().join("collected");
        std::fs::write(&out, &collected).unwrap();
        assert_eq!(got.digest.to_string(), sha256sum(&out));
        // Over the caller's limit: refused, and nothing reaches the sink.
        let mut sink = Vec::new();
        let err = s
            .runtime
            .collect("suite-1", "out.bin", 2, &mut sink)
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "run suite-1: out.bin is 3 bytes, over the 2 byte limit; raise --max-bytes or collect a smaller file"
        );
        assert!(sink.is_empty());
        let listed: Vec<String> = s
            .runtime
            .list()
            .unwrap()
            .into_iter()
            .map(|st| st.run_id)
            .collect();
        assert!(listed.contains(&"suite-1".to_string()), "{listed:?}");
    }

    /// A stop ends the run promptly and its outcome says it was stopped; an unknown run is named.
    pub fn a_stop_ends_the_run_and_says_so(s: &Subject) {
        let mut spec = shell("suite-long", &s.shell, "sleep 30 & wait");
        spec.grace = Some(Duration::from_millis(500));
        s.runtime.start(&spec).unwrap();
        wait_for(s.runtime, "suite-long", RunState::Running);
        let begun = Instant::now();
        s.runtime.stop("suite-long").unwrap();
        assert!(begun.elapsed() < Duration::from_secs(10));
        let status = s.runtime.status("suite-long").unwrap();
        assert!(status.state.is_final(), "{}", status.state);
        assert!(status.report.outcome.unwrap().stopped);
        let err = s.runtime.stop("suite-nope").unwrap_err();
        assert!(
            matches!(&err, RuntimeError::UnknownRun { run_id } if run_id == "suite-nope"),
            "{err:?}"
        );
    }

    /// A timeout ends the run and the outcome says so.
    pub fn a_timeout_ends_the_run(s: &Subject) {
        let mut spec = shell("suite-slow", &s.shell, "sleep 30");
        spec.timeout = Some(Duration::from_millis(300));
        spec.grace = Some(Duration::from_millis(200));
        s.runtime.start(&spec).unwrap();
        let done = wait_for(s.runtime, "suite-slow", RunState::Finished);
        assert!(done.report.outcome.unwrap().timed_out);
    }

    /// Collect never leaves the run's folder, and unknown runs are named.
    pub fn refusals_are_one_line_per_run(s: &Subject) {
        s.runtime
            .start(&shell("suite-2", &s.shell, "echo hi > file && ln -s / top"))
            .unwrap();
        wait_for(s.runtime, "suite-2", RunState::Finished);
        for path in ["../suite-1/file", "/etc/passwd", "top/etc/passwd"] {
            let err = s
                .runtime
                .collect("suite-2", path, 1 << 20, &mut Vec::new())
                .unwrap_err();
            assert_eq!(
                err.to_string(),
                format!(
                    "run suite-2: collect path {path} leaves the run folder; name a file inside it"
                )
            );
        }
        assert_eq!(
            s.runtime.status("suite-nope").unwrap_err().to_string(),
            "run suite-nope is not known to the run store"
        );
        let err = s
            .runtime
            .collect("suite-nope", "file", 1 << 20, &mut Vec::new())
            .unwrap_err();
        assert!(matches!(&err, RuntimeError::UnknownRun { .. }), "{err:?}");
    }

    /// What a runtime cannot enforce is refused before anything runs, never ignored.
    pub fn what_it_cannot_do_is_refused(s: &Subject, unsupported: Resources) {
        let mut spec = shell("suite-limits", &s.shell, "true");
        spec.resources = unsupported;
        let err = s.runtime.start(&spec).unwrap_err();
        assert!(
            matches!(&err, RuntimeError::Unsupported { runtime, .. } if *runtime == s.name),
            "{err:?}"
        );
        assert!(s.runtime.status("suite-limits").is_err(), "nothing started");
    }
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
    };
    suite::starts_once_and_collects(&subject);
    suite::a_stop_ends_the_run_and_says_so(&subject);
    suite::a_timeout_ends_the_run(&subject);
    suite::refusals_are_one_line_per_run(&subject);
    suite::what_it_cannot_do_is_refused(
        &subject,
        Resources {
            memory_bytes: Some(64 << 20),
            ..Resources::default()
        },
    );
    // An image is a container runtime's workload.
    let image = Workload::Image(format!("127.0.0.1:5000/app@sha256:{}", "a".repeat(64)));
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
    let failed = rt.status("bad-1").unwrap();
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
    let mut spec = RunSpec::new("big", program.clone());
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
    let status = rt.status("big").unwrap();
    assert_eq!(status.state, RunState::Failed);
    assert_eq!(status.report.error, Some(format!("input: {reason}")));
    // The partial copy made no lasting mess: the next run with a small input starts and ends.
    let small = dir.path().join("small");
    std::fs::write(&small, "fits\n").unwrap();
    let mut next = RunSpec::new("next", program);
    next.inputs = vec![("data".into(), small)];
    assert_eq!(rt.start(&next).unwrap(), Started::New);
    let done = wait_for(&rt, "next", RunState::Finished);
    assert_eq!(done.report.outcome.unwrap().exit_code, Some(0));
}

/// Every state spooled for each run, in order.
fn spooled(store: &Store) -> BTreeMap<String, Vec<RunState>> {
    let mut by_run: BTreeMap<String, Vec<RunState>> = BTreeMap::new();
    for e in store.pending_events(0, usize::MAX).unwrap() {
        by_run.entry(e.run_id).or_default().push(e.state);
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
        store.track_run(run, &program).unwrap();
        rt.start(&shell(run, &program, script)).unwrap();
    }
    // Tracked, never launched (the agent died before the start): left alone, not reported lost.
    store.track_run("pending", &program).unwrap();
    let report = sync_runs(&store, &rt).unwrap();
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(report.events.len(), 2, "{:?}", report.events);

    // The long run's supervisor dies (and we end its orphaned program, which nobody watches now).
    let owner = rt.status("long").unwrap().report.detail["owner"].clone();
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
        store.track_run(&run, &program).unwrap();
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
        std::thread::sleep(Duration::from_micros(rng.below(60_000)));
        child.kill().unwrap();
        child.wait().unwrap();
        restarts += 1;
        let store = Store::open(&state_dir).unwrap();
        for e in store.pending_events(last_id, usize::MAX).unwrap() {
            assert!(e.id > last_id);
            last_id = e.id;
            assert!(
                delivered.insert((e.run_id.clone(), e.state)),
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
