//! The behaviour every runtime must show, whatever runs the work (a supervised process, a
//! container). A runtime passes by giving a runtime and a workload whose program is a POSIX
//! shell; `tests/it/agent_runtime.rs` runs it for the process runtime, `agent_docker.rs` for
//! the Docker one.
use crate::rid;
use fleet_agent::runtime::{
    Resources, RunSpec, RunState, RunStatus, Runtime, RuntimeError, Started, Workload,
};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

pub struct Subject<'a> {
    pub runtime: &'a dyn Runtime,
    /// A workload whose program is `/bin/sh`.
    pub shell: Workload,
    /// The runtime's name in its `Unsupported` errors.
    pub name: &'static str,
    /// Whether arguments may be any bytes; a runtime that carries only text must refuse the
    /// others as unsupported (the Engine API's JSON carries strings).
    pub argv_bytes: bool,
}

/// `sha256:HEX` of a file, by `sha256sum`: an oracle independent of our code.
pub fn sha256sum(path: &Path) -> String {
    let out = crate::ok(Command::new("sha256sum").arg(path));
    format!("sha256:{}", out.split_whitespace().next().unwrap())
}

/// Polls the runtime until the run reaches `state` (or fails the test after 60 s).
pub fn wait_for(rt: &dyn Runtime, run: &str, state: RunState) -> RunStatus {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let status = rt.status(&rid(run)).unwrap();
        if status.state == state {
            return status;
        }
        assert!(
            Instant::now() < deadline,
            "run {run} stuck in {}: {:?}",
            status.state,
            status.report
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A spec running `/bin/sh -c SCRIPT sh ARG...` from a workload that is a shell.
pub fn shell(run: &str, shell: &Workload, script: &str) -> RunSpec {
    let mut spec = RunSpec::new(rid(run), shell.clone());
    spec.argv = vec!["-c".into(), script.into(), "sh".into()];
    spec.timeout = Some(Duration::from_secs(20));
    spec
}

/// Reads a whole file out of a run.
pub fn collected(rt: &dyn Runtime, run: &str, path: &str) -> Vec<u8> {
    let mut bytes = Vec::new();
    rt.collect(&rid(run), path, 1 << 20, &mut bytes).unwrap();
    bytes
}

/// Started once (a redelivered start launches nothing), arguments exactly as given, the
/// environment, a typed outcome, a streamed collect with its digest, and the run listed.
pub fn starts_once_and_collects(s: &Subject) {
    use std::os::unix::ffi::OsStringExt;
    let dir = crate::tempdir();
    let script = r#"printf %s "$1" > out.bin; echo "$MARK" >> marks; echo to-stderr >&2; exit 3"#;
    let bytes = vec![0xff, b'a', 0xfe];
    let mut spec = shell("suite-1", &s.shell, script);
    spec.argv.push(std::ffi::OsString::from_vec(bytes.clone()));
    spec.env = vec![("MARK".into(), "ran".into())];
    let argument = if s.argv_bytes {
        bytes
    } else {
        let err = s.runtime.start(&spec).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "run suite-1: argument 4 (not UTF-8) is not supported by the {} runtime; the Engine API carries arguments as text; pass UTF-8 or run it as a program",
                s.name
            )
        );
        assert!(
            s.runtime.status(&rid("suite-1")).is_err(),
            "nothing started"
        );
        let text = "it's \"quoted\"  and spaced ";
        spec.argv[3] = text.into();
        text.as_bytes().to_vec()
    };
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
    assert_eq!(collected(s.runtime, "suite-1", "marks"), b"ran\n");

    let mut got_bytes = Vec::new();
    let got = s
        .runtime
        .collect(&rid("suite-1"), "out.bin", 1024, &mut got_bytes)
        .unwrap();
    assert_eq!(got_bytes, argument);
    assert_eq!(got.size, argument.len() as u64);
    let out = dir.path().join("collected");
    std::fs::write(&out, &got_bytes).unwrap();
    assert_eq!(got.digest.to_string(), sha256sum(&out));
    // Over the caller's limit: refused, and nothing reaches the sink.
    let mut sink = Vec::new();
    let err = s
        .runtime
        .collect(&rid("suite-1"), "out.bin", 2, &mut sink)
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "run suite-1: out.bin is {} bytes, over the 2 byte limit; raise --max-bytes or collect a smaller file",
            argument.len()
        )
    );
    assert!(sink.is_empty());
    let listed: Vec<String> = s
        .runtime
        .list()
        .unwrap()
        .into_iter()
        .map(|st| st.run_id.to_string())
        .collect();
    assert!(listed.contains(&"suite-1".to_string()), "{listed:?}");
}

/// A stop ends the run, and its outcome says it was stopped (not timed out); an unknown run is
/// named.
pub fn a_stop_ends_the_run_and_says_so(s: &Subject) {
    let mut spec = shell("suite-long", &s.shell, "sleep 30 & wait");
    spec.grace = Some(Duration::from_millis(500));
    s.runtime.start(&spec).unwrap();
    wait_for(s.runtime, "suite-long", RunState::Running);
    let begun = Instant::now();
    s.runtime.stop(&rid("suite-long")).unwrap();
    eprintln!("{}: the stop returned after {:?}", s.name, begun.elapsed());
    let status = s.runtime.status(&rid("suite-long")).unwrap();
    assert!(status.state.is_final(), "{}", status.state);
    let outcome = status.report.outcome.unwrap();
    assert!(outcome.stopped && !outcome.timed_out, "{outcome:?}");
    let err = s.runtime.stop(&rid("suite-nope")).unwrap_err();
    assert!(
        matches!(&err, RuntimeError::UnknownRun { run_id } if run_id.as_str() == "suite-nope"),
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
    let outcome = done.report.outcome.unwrap();
    assert!(outcome.timed_out && !outcome.stopped, "{outcome:?}");
}

/// Collect never leaves the run's folder, and unknown runs are named.
pub fn refusals_are_one_line_per_run(s: &Subject) {
    s.runtime
        .start(&shell("suite-2", &s.shell, "echo hi > file && ln -s / top"))
        .unwrap();
    wait_for(s.runtime, "suite-2", RunState::Finished);
    for path in ["../suite-1/file", "/etc/passwd", "top/etc/passwd", "top"] {
        let err = s
            .runtime
            .collect(&rid("suite-2"), path, 1 << 20, &mut Vec::new())
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "run suite-2: collect path {path} leaves the run folder; name a file inside it"
            )
        );
    }
    assert_eq!(collected(s.runtime, "suite-2", "./file"), b"hi\n");
    assert_eq!(
        s.runtime
            .status(&rid("suite-nope"))
            .unwrap_err()
            .to_string(),
        "run suite-nope is not known to this node's runtimes; check the run id"
    );
    let err = s
        .runtime
        .collect(&rid("suite-nope"), "file", 1 << 20, &mut Vec::new())
        .unwrap_err();
    assert!(matches!(&err, RuntimeError::UnknownRun { .. }), "{err:?}");
}

/// What a runtime cannot enforce is refused before anything runs, never ignored; returns the
/// refusal for the caller's runtime-specific wording checks.
pub fn what_it_cannot_do_is_refused(s: &Subject, unsupported: Resources) -> RuntimeError {
    let mut spec = shell("suite-limits", &s.shell, "true");
    spec.resources = unsupported;
    let err = s.runtime.start(&spec).unwrap_err();
    assert!(
        matches!(&err, RuntimeError::Unsupported { runtime, .. } if *runtime == s.name),
        "{err:?}"
    );
    assert!(
        s.runtime.status(&rid("suite-limits")).is_err(),
        "nothing started"
    );
    err
}

/// Every part of the suite, in order.
pub fn run_all(s: &Subject, unsupported: Resources) -> RuntimeError {
    starts_once_and_collects(s);
    a_stop_ends_the_run_and_says_so(s);
    a_timeout_ends_the_run(s);
    refusals_are_one_line_per_run(s);
    what_it_cannot_do_is_refused(s, unsupported)
}
