//! Tests: `fleet-run-supervisor` and its run store, with real processes, real kills, a real
//! tmpfs for the full and read-only disk, `sha256sum` as the hashing oracle and /proc as the
//! oracle for surviving processes.
use serde_json::Value;
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};
use testkit::{fails, ok, output, tempdir};

const BIN: &str = "fleet-run-supervisor";
/// Long enough that only a real failure reaches it, on a loaded machine too.
const WAIT: Duration = Duration::from_secs(60);

/// A store in a fresh temporary folder.
struct Store {
    _tmp: tempfile::TempDir,
    root: PathBuf,
}

impl Store {
    fn new() -> Self {
        let tmp = tempdir();
        let root = tmp.path().join("store-root");
        Self { _tmp: tmp, root }
    }

    fn at(root: &Path) -> Self {
        Self {
            _tmp: tempdir(),
            root: root.to_path_buf(),
        }
    }

    fn cmd(&self) -> Command {
        let mut c = testkit::cmd(BIN);
        c.arg("--root").arg(&self.root);
        c
    }

    fn stage(&self, file: &Path) -> String {
        let mut c = self.cmd();
        c.arg("stage").arg(file);
        ok(&mut c).trim().to_string()
    }

    /// Stages a `/bin/sh` script.
    fn script(&self, body: &str) -> String {
        let path = self._tmp.path().join(format!("script-{}", unique()));
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
        self.stage(&path)
    }

    fn start(&self, run: &str, program: &str, flags: &[&str], args: &[&OsStr]) -> Output {
        let mut c = self.cmd();
        c.args(["start", "--run", run, "--program", program])
            .args(flags)
            .arg("--")
            .args(args);
        output(&mut c)
    }

    /// Starts a run that must reach `running`.
    fn run(&self, run: &str, program: &str, flags: &[&str]) {
        let out = self.start(run, program, flags, &[]);
        assert!(
            out.status.success(),
            "start {run} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(String::from_utf8_lossy(&out.stdout), "running\n");
    }

    fn json(&self, command: &str, run: &str) -> Value {
        let mut c = self.cmd();
        c.args([command, "--run", run, "--json"]);
        serde_json::from_str(&ok(&mut c)).unwrap()
    }

    fn wait(&self, run: &str) -> Value {
        self.json("wait", run)
    }

    fn status(&self, run: &str) -> Value {
        self.json("status", run)
    }

    fn run_dir(&self, run: &str) -> PathBuf {
        self.root.join("runs").join(run)
    }
}

fn unique() -> String {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    format!(
        "{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

fn stderr_line(out: &Output) -> String {
    assert!(!out.status.success(), "expected a failure");
    String::from_utf8(out.stderr.clone()).unwrap()
}

/// `sha256sum` as an independent oracle.
fn sha256sum(path: &Path) -> String {
    let out = ok(Command::new("sha256sum").arg(path));
    format!("sha256:{}", out.split_whitespace().next().unwrap())
}

/// Whether a live process has `marker` among its arguments (the /proc oracle for survivors).
fn processes_with(marker: &str) -> Vec<u32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| {
                s.rsplit(')')
                    .next()
                    .unwrap_or("")
                    .trim_start()
                    .starts_with('Z')
            })
            .unwrap_or(true);
        if !zombie && cmdline.split(|&b| b == 0).any(|a| a == marker.as_bytes()) {
            found.push(pid);
        }
    }
    found
}

fn alive(pid: u64) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            !s.rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
        })
        .unwrap_or(false)
}

/// Whether `pid` is blocked on a `flock` (a `->` line of /proc/locks).
fn waits_for_a_lock(pid: u32) -> bool {
    let locks = std::fs::read_to_string("/proc/locks").unwrap_or_default();
    let pid = pid.to_string();
    locks.lines().any(|line| {
        let words: Vec<&str> = line.split_whitespace().collect();
        words.get(1) == Some(&"->") && words.get(5) == Some(&pid.as_str())
    })
}

fn wait_until(what: &str, limit: Duration, mut check: impl FnMut() -> bool) {
    let start = Instant::now();
    while !check() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether this process may create a child of its cgroup v2 (the oracle for which containment
/// the supervisor should pick here).
fn cgroup_creatable() -> bool {
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let Some(own) = own.lines().find_map(|l| l.strip_prefix("0::")) else {
        return false;
    };
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let Some(mount) = info.lines().find_map(|l| {
        let (left, right) = l.split_once(" - ")?;
        right
            .starts_with("cgroup2 ")
            .then(|| left.split_whitespace().nth(4))?
    }) else {
        return false;
    };
    let probe = Path::new(mount)
        .join(own.trim_start_matches('/'))
        .join(format!("fleet-test-probe-{}", unique()));
    let made = std::fs::create_dir(&probe).is_ok() && probe.join("cgroup.kill").exists();
    let _ = std::fs::remove_dir(&probe);
    made
}

/// A tmpfs mounted for one test (we are root), unmounted when dropped.
struct Tmpfs {
    dir: PathBuf,
    _tmp: tempfile::TempDir,
}

impl Tmpfs {
    fn mount(options: &str) -> Self {
        let tmp = tempdir();
        let dir = tmp.path().join("mnt");
        std::fs::create_dir(&dir).unwrap();
        ok(Command::new("mount")
            .args(["-t", "tmpfs", "-o", options, "tmpfs"])
            .arg(&dir));
        Self { dir, _tmp: tmp }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
    }
}

#[test]
fn runs_a_program_with_a_clean_environment_and_records_how_it_ended() {
    let s = Store::new();
    let p = s.script("echo \"out $PWD\"; echo err >&2; env | sort > env.txt; exit 3");
    let mut c = s.cmd();
    c.env("CALLER_SECRET", "must-not-leak").args([
        "start",
        "--run",
        "basic",
        "--program",
        &p,
        "--env",
        "EXTRA=1",
    ]);
    assert_eq!(ok(&mut c), "running\n");
    let v = s.wait("basic");
    let r = &v["result"];
    assert_eq!(v["state"], "finished");
    assert_eq!(r["schema"], 1);
    assert_eq!(r["run"], "basic");
    assert_eq!(r["program"], p);
    assert_eq!(r["exit_code"], 3);
    assert_eq!(r["signal"], Value::Null);
    assert_eq!(r["timed_out"], false);
    assert!(r["duration_s"].as_f64().unwrap() > 0.0);
    let dir = s.run_dir("basic");
    let stdout = std::fs::read_to_string(dir.join("stdout")).unwrap();
    assert_eq!(stdout, format!("out {}\n", dir.display()));
    assert_eq!(r["stdout"]["bytes"], stdout.len());
    assert_eq!(r["stdout"]["sha256"], sha256sum(&dir.join("stdout")));
    assert_eq!(r["stderr"]["sha256"], sha256sum(&dir.join("stderr")));
    assert_eq!(r["stderr"]["truncated"], false);
    assert_eq!(v["stderr"]["first"], "err\n");
    let env = std::fs::read_to_string(dir.join("env.txt")).unwrap();
    let expected = format!(
        "EXTRA=1\nFLEET_RUN_ID=basic\nHOME={home}\nLANG=C.UTF-8\n\
         PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\nPWD={home}\n",
        home = dir.display()
    );
    assert_eq!(env, expected);
    // The text form names the outcome.
    let mut c = s.cmd();
    c.args(["status", "--run", "basic"]);
    assert!(ok(&mut c).starts_with("run basic: finished, exit code 3, in "));
}

#[test]
fn argv_torture_list_arrives_byte_for_byte() {
    let s = Store::new();
    let p = s.script("printf '%s\\0' \"$@\"");
    let args: Vec<OsString> = vec![
        "plain".into(),
        "two words".into(),
        "".into(),
        "'single' \"double\"".into(),
        "*".into(),
        "$(touch pwned)".into(),
        "`id`".into(),
        "line\nbreak".into(),
        "--".into(),
        "-h".into(),
        "--run".into(),
        "tab\there".into(),
        "ünïcødé ✓".into(),
        OsString::from_vec(vec![0xff, 0xfe, b'x', 0x80]),
        "\\back\\slash".into(),
        ";|&><".into(),
    ];
    let refs: Vec<&OsStr> = args.iter().map(OsString::as_os_str).collect();
    let out = s.start("argv", &p, &[], &refs);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = s.wait("argv");
    assert_eq!(v["result"]["exit_code"], 0);
    let dir = s.run_dir("argv");
    let got = std::fs::read(dir.join("stdout")).unwrap();
    let want: Vec<u8> = args
        .iter()
        .flat_map(|a| a.as_bytes().iter().copied().chain([0]))
        .collect();
    assert_eq!(got, want);
    assert!(!dir.join("pwned").exists(), "no shell ran the arguments");
    // result.json: argv[0] is the staged program, then every argument; non-UTF-8 as hex.
    let argv = v["result"]["argv"].as_array().unwrap();
    assert_eq!(argv.len(), args.len() + 1);
    assert!(
        argv[0]
            .as_str()
            .unwrap()
            .ends_with(p.trim_start_matches("sha256:"))
    );
    assert_eq!(argv[3], "");
    assert_eq!(argv[8], "line\nbreak");
    assert_eq!(argv[14], serde_json::json!({"hex": "fffe7880"}));
}

#[test]
fn timeout_kills_a_child_that_ignores_sigterm() {
    let s = Store::new();
    // SIG_IGN is inherited, so the sleeps ignore SIGTERM too.
    let p = s.script("trap '' TERM; while :; do sleep 0.05; done");
    s.run("stubborn", &p, &["--timeout", "0.5", "--grace", "0.5"]);
    let r = s.wait("stubborn")["result"].clone();
    assert_eq!(r["state"], "finished");
    assert_eq!(r["timed_out"], true);
    assert_eq!(r["killed"], true);
    assert_eq!(r["signal"], 9);
    assert_eq!(r["exit_code"], Value::Null);
    assert_eq!(r["grace_used_s"], 0.5);
    let d = r["duration_s"].as_f64().unwrap();
    eprintln!("timeout 0.5 s and grace 0.5 s: killed after {d} s");
    assert!(
        d >= 0.95,
        "killed after {d} s, before its timeout and grace"
    );

    // A polite child ends at SIGTERM, well inside its grace period.
    let p = s.script("exec sleep 100");
    s.run("polite", &p, &["--timeout", "0.3", "--grace", "5"]);
    let r = s.wait("polite")["result"].clone();
    assert_eq!(r["timed_out"], true);
    assert_eq!(r["killed"], false, "the 5 s grace was waited out");
    assert_eq!(r["signal"], 15);
    eprintln!(
        "SIGTERM ended it after {} s of its grace",
        r["grace_used_s"]
    );

    // Unlike timeout(1), a program's own 124 is not mistaken for a timeout.
    let p = s.script("exit 124");
    s.run("own-124", &p, &["--timeout", "30"]);
    let r = s.wait("own-124")["result"].clone();
    assert_eq!(r["exit_code"], 124);
    assert_eq!(r["timed_out"], false);
}

/// The program starts a setsid'd daemon and a double-forked one, then exits: the run goes on
/// while they live, and at the timeout both die. Checked in both containment modes.
#[test]
fn daemons_die_at_the_timeout_setsid_and_double_forked_included() {
    for (mode, flags) in [("cgroup", &[][..]), ("process-group", &["--no-cgroup"][..])] {
        let s = Store::new();
        let marker_a = format!("1000.{}", unique().replace('-', ""));
        let marker_b = format!("1001.{}", unique().replace('-', ""));
        let p = s.script(&format!(
            "setsid sleep {marker_a} >/dev/null 2>&1 < /dev/null &\n\
             ( sh -c 'sleep {marker_b} >/dev/null 2>&1 &' & )\n\
             exit 0"
        ));
        // Long enough to see the daemons and the run alive before it, on a loaded machine too.
        let mut all = vec!["--timeout", "5", "--grace", "1"];
        all.extend_from_slice(flags);
        s.run("daemons", &p, &all);
        wait_until("the daemons to start", WAIT, || {
            !processes_with(&marker_a).is_empty() && !processes_with(&marker_b).is_empty()
        });
        assert_eq!(s.status("daemons")["state"], "running", "{mode}");
        let r = s.wait("daemons")["result"].clone();
        let expected = if mode == "cgroup" && !cgroup_creatable() {
            "process-group"
        } else {
            mode
        };
        assert_eq!(r["containment"], expected);
        assert_eq!(r["exit_code"], 0, "the program itself exited 0");
        assert_eq!(r["timed_out"], true);
        assert!(
            processes_with(&marker_a).is_empty(),
            "{mode}: setsid daemon survived"
        );
        assert!(
            processes_with(&marker_b).is_empty(),
            "{mode}: double-forked daemon survived"
        );
    }
}

#[test]
fn hundred_mib_of_output_under_a_one_mib_limit() {
    let s = Store::new();
    let p = s.script("head -c 104857600 /dev/zero; printf END; echo small >&2");
    s.run("flood", &p, &["--output-limit", "1048576"]);
    let v = s.wait("flood");
    let r = &v["result"];
    assert_eq!(r["exit_code"], 0);
    assert_eq!(r["stdout"]["bytes"], 104_857_603u64);
    assert_eq!(r["stdout"]["kept"], 1_048_576);
    assert_eq!(r["stdout"]["truncated"], true);
    assert_eq!(r["stderr"]["truncated"], false);
    let dir = s.run_dir("flood");
    assert_eq!(
        std::fs::metadata(dir.join("stdout")).unwrap().len(),
        1_048_576
    );
    // The oracle hashes the whole stream the program wrote.
    let full = ok(Command::new("sh")
        .arg("-c")
        .arg("{ head -c 104857600 /dev/zero; printf END; } | sha256sum"));
    assert_eq!(
        r["stdout"]["sha256"],
        format!("sha256:{}", full.split_whitespace().next().unwrap())
    );
    let last = v["stdout"]["last"].as_str().unwrap();
    assert_eq!(last.len(), 1024);
    assert!(last.ends_with("\0\0END"));
    assert_eq!(v["stdout"]["first"].as_str().unwrap(), "\0".repeat(1024));
}

#[test]
fn a_sigkilled_supervisor_leaves_a_lost_run_and_no_program() {
    let s = Store::new();
    let p = s.script("exec sleep 100");
    s.run("orphan", &p, &[]);
    let v = s.status("orphan");
    assert_eq!(v["state"], "running");
    let program = v["owner"]["program_pid"].as_u64().unwrap();
    kill_supervisor(&s, "orphan");
    let v = s.status("orphan");
    assert_eq!(v["state"], "lost");
    assert_eq!(v["result"], Value::Null);
    let v = s.wait("orphan");
    assert_eq!(v["state"], "lost", "wait ends too");
    wait_until("the program to die with it", WAIT, || !alive(program));
    let mut c = s.cmd();
    c.args(["list"]);
    assert!(ok(&mut c).contains("orphan\tlost\t"));
}

/// SIGKILLs a running run's supervisor and waits until it is gone.
fn kill_supervisor(s: &Store, run: &str) {
    let supervisor = s.status(run)["owner"]["pid"].as_u64().unwrap();
    ok(Command::new("kill").args(["-KILL", &supervisor.to_string()]));
    wait_until("the supervisor to die", WAIT, || !alive(supervisor));
}

#[test]
fn two_hundred_runs_at_once() {
    let s = Store::new();
    let p = s.script("echo \"$FLEET_RUN_ID\"");
    let children: Vec<_> = (0..200)
        .map(|i| {
            s.cmd()
                .args(["start", "--run", &format!("many-{i}"), "--program", &p])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for child in children {
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    for i in 0..200 {
        let run = format!("many-{i}");
        let v = s.wait(&run);
        assert_eq!(v["result"]["exit_code"], 0, "{run}");
        assert_eq!(v["stdout"]["first"], format!("{run}\n"));
    }
}

#[test]
fn one_id_started_at_once_by_many_starts_exactly_once() {
    let s = Store::new();
    let p = s.script("true");
    let children: Vec<_> = (0..20)
        .map(|_| {
            s.cmd()
                .args(["start", "--run", "same", "--program", &p])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outs: Vec<Output> = children
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    assert_eq!(outs.iter().filter(|o| o.status.success()).count(), 1);
    let refusal = format!(
        "fleet-run-supervisor: run \"same\" already exists in {}: a run id is started at most once\n",
        s.root.join("runs").display()
    );
    for o in outs.iter().filter(|o| !o.status.success()) {
        assert_eq!(String::from_utf8_lossy(&o.stderr), refusal);
    }
    assert_eq!(s.wait("same")["result"]["exit_code"], 0);
}

#[test]
fn retention_keeps_exactly_the_newest_n_finished_runs() {
    let s = Store::new();
    let p = s.script("true");
    // A lost run and a running one are never removed, however old.
    let sleeper = s.script("exec sleep 100");
    s.run("lost", &sleeper, &[]);
    kill_supervisor(&s, "lost");
    s.run("running", &sleeper, &["--keep", "3"]);
    for i in 0..7 {
        let run = format!("keep-{i}");
        s.run(&run, &p, &["--keep", "3"]);
        s.wait(&run);
    }
    // A finished run removed by hand leaves its marker, counted (so the store holds fewer,
    // never more) until it is the oldest and dropped.
    std::fs::remove_dir_all(s.run_dir("keep-6")).unwrap();
    for i in 7..10 {
        let run = format!("keep-{i}");
        s.run(&run, &p, &["--keep", "3"]);
        s.wait(&run);
    }
    let mut c = s.cmd();
    c.args(["list", "--json"]);
    let v: Value = serde_json::from_str(&ok(&mut c)).unwrap();
    let ids: Vec<(&str, &str)> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["run"].as_str().unwrap(), r["state"].as_str().unwrap()))
        .collect();
    assert_eq!(
        ids,
        [
            ("keep-7", "finished"),
            ("keep-8", "finished"),
            ("keep-9", "finished"),
            ("lost", "lost"),
            ("running", "running")
        ]
    );
    // One marker per finished run kept, oldest first by name. Pruning runs after the waiters are
    // released, so the last run's supervisor may still be at it when `wait` returns.
    let markers = || {
        let mut names: Vec<String> = std::fs::read_dir(s.root.join("finished"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .map(|m| m.split_once('-').unwrap().1.to_string())
            .collect();
        names.sort();
        names
    };
    let pruned = testkit::agent::wait_until(WAIT, || markers() == ["keep-7", "keep-8", "keep-9"]);
    assert!(pruned, "markers left: {:?}", markers());
    let left: Vec<_> = std::fs::read_dir(s.root.join("runs")).unwrap().collect();
    assert_eq!(left.len(), 5);
    let mut c = s.cmd();
    c.args(["stop", "--run", "running"]);
    ok(&mut c);
}

#[test]
fn a_program_that_plants_symlinks_for_the_record_cannot_make_it_write_elsewhere() {
    let s = Store::new();
    let tmp = tempdir();
    let victim = tmp.path().join("victim");
    std::fs::write(&victim, "untouched\n").unwrap();
    // The owner file the record is written over, and the temporary name a fallback would use.
    // The supervisor is the program's parent; its owner file is in place once start returns.
    let p = s.script(&format!(
        "sleep 0.3; ln -sf {v} supervisor.json; ln -sf {v} .result.json.tmp-$PPID",
        v = victim.display()
    ));
    s.run("planted", &p, &[]);
    let v = s.wait("planted");
    assert_eq!(v["result"]["exit_code"], 0);
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "untouched\n");
    let record = s.run_dir("planted").join("result.json");
    assert!(std::fs::symlink_metadata(&record).unwrap().is_file());
}

#[test]
fn wait_wakes_when_the_supervisor_dies_and_reports_lost() {
    let s = Store::new();
    let p = s.script("exec sleep 100");
    s.run("doomed", &p, &[]);
    let mut waiter = s.cmd();
    waiter
        .args(["wait", "--run", "doomed", "--json"])
        .stdout(std::process::Stdio::piped());
    let waiter = waiter.spawn().unwrap();
    wait_until("the waiter to block on the run's lock", WAIT, || {
        waits_for_a_lock(waiter.id())
    });
    kill_supervisor(&s, "doomed");
    // The kernel lets go of the run's lock with the supervisor, which wakes the waiter.
    let out = waiter.wait_with_output().unwrap();
    assert!(out.status.success());
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["state"], "lost");
    assert_eq!(v["result"], Value::Null);
}

#[test]
fn stop_ends_a_run_the_way_its_timeout_would() {
    let s = Store::new();
    let p = s.script("exec sleep 100");
    s.run("stopme", &p, &[]);
    let mut c = s.cmd();
    c.args(["stop", "--run", "stopme"]);
    assert!(ok(&mut c).starts_with("run stopme: finished, killed by SIGTERM, stopped, in "));
    let r = s.status("stopme")["result"].clone();
    assert_eq!(r["stopped"], true);
    assert_eq!(r["timed_out"], false);
    assert_eq!(r["signal"], 15);
}

#[test]
fn inputs_are_copied_in_and_collect_refuses_paths_that_leave_the_run() {
    let s = Store::new();
    let tmp = tempdir();
    let input = tmp.path().join("in.txt");
    std::fs::write(&input, "payload\n").unwrap();
    let p = s.script(
        "mkdir -p out && tr a-z A-Z < data > out/upper.txt && ln -s /etc link && ln -s .. up",
    );
    let arg = format!("data={}", input.display());
    s.run("files", &p, &["--input", &arg]);
    assert_eq!(s.wait("files")["result"]["exit_code"], 0);
    let dest = tmp.path().join("got.txt");
    let collect = |path: &str| {
        let mut c = s.cmd();
        c.args(["collect", "--run", "files", "--path", path, "--out"])
            .arg(&dest);
        output(&mut c)
    };
    let out = collect("out/upper.txt");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(std::fs::read_to_string(&dest).unwrap(), "PAYLOAD\n");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        sha256sum(&dest)
    );
    let refused = [
        (
            "../files/data",
            "path \"../files/data\" leaves the run folder: `..` is not allowed",
        ),
        (
            "/etc/passwd",
            "path \"/etc/passwd\" leaves the run folder: give a path relative to it, not an absolute one",
        ),
        (
            "link/passwd",
            "path \"link/passwd\" leaves the run folder through the symlink \"link\": symlinks are not followed",
        ),
        (
            "up",
            "path \"up\" leaves the run folder through the symlink \"up\": symlinks are not followed",
        ),
        ("nope", "path \"nope\" does not exist in run \"files\""),
    ];
    for (path, message) in refused {
        assert_eq!(
            stderr_line(&collect(path)),
            format!("fleet-run-supervisor: {message}\n")
        );
    }
}

#[test]
fn bad_input_gets_one_clear_line_and_leaves_other_runs_untouched() {
    let s = Store::new();
    let good = s.script("echo fine");
    s.run("good", &good, &[]);
    s.wait("good");
    let before = std::fs::read(s.run_dir("good").join("result.json")).unwrap();
    let root = s.root.display().to_string();
    let line = |out: Output| stderr_line(&out).trim_end().to_string();
    let prefix = "fleet-run-supervisor: ";

    let unknown = format!("sha256:{}", "0".repeat(64));
    assert_eq!(
        line(s.start("r-unknown", &unknown, &[], &[])),
        format!(
            "{prefix}program {unknown} is not staged in {root}: run `fleet-run-supervisor stage FILE` first"
        )
    );
    let failed = s.status("r-unknown");
    assert_eq!(failed["state"], "failed");
    assert_eq!(failed["result"]["failure"]["step"], "stage");

    let tmp = tempdir();
    let data = tmp.path().join("data.bin");
    std::fs::write(&data, "just some text\n").unwrap();
    let not_exec = s.stage(&data);
    assert_eq!(
        line(s.start("r-noexec", &not_exec, &[], &[])),
        format!("{prefix}program {not_exec} cannot be executed: exec format error")
    );
    assert_eq!(s.status("r-noexec")["result"]["failure"]["step"], "exec");

    for bad in ["a/b", "", "..", ".", &"x".repeat(65), "sp ace"] {
        assert_eq!(
            line(s.start(bad, &good, &[], &[])),
            format!(
                "{prefix}bad run id {bad:?}: use 1 to 64 characters of A-Z a-z 0-9 . _ - (not . or ..)"
            )
        );
    }
    assert_eq!(
        line(s.start("good", &good, &[], &[])),
        format!(
            "{prefix}run \"good\" already exists in {root}/runs: a run id is started at most once"
        )
    );
    assert_eq!(
        line(s.start("r-digest", "sha256:xyz", &[], &[])),
        format!(
            "{prefix}bad program digest \"sha256:xyz\": use sha256: followed by 64 lowercase hex digits"
        )
    );
    assert_eq!(
        line(s.start(
            "r-input",
            &good,
            &["--input", "data=/nonexistent/file"],
            &[]
        )),
        format!(
            "{prefix}input \"data\" cannot be read from /nonexistent/file: no such file or directory"
        )
    );
    assert_eq!(s.status("r-input")["result"]["failure"]["step"], "input");

    // A staged program whose bytes changed is refused at the verify step.
    let tampered = s.script("echo original");
    let staged = s
        .root
        .join("store/sha256")
        .join(tampered.trim_start_matches("sha256:"));
    std::fs::write(&staged, "#!/bin/sh\necho tampered\n").unwrap();
    let err = line(s.start("r-verify", &tampered, &[], &[]));
    assert!(
        err.starts_with(&format!("{prefix}program {tampered} in {root} no longer matches its digest (its bytes hash to sha256:")),
        "{err}"
    );
    assert!(err.ends_with("): stage it again"), "{err}");
    assert_eq!(s.status("r-verify")["result"]["failure"]["step"], "verify");

    let mut c = s.cmd();
    c.args(["status", "--run", "never"]);
    assert_eq!(
        fails(&mut c).trim_end(),
        format!("{prefix}run \"never\" does not exist in {root}/runs: check the run id and --root")
    );
    assert_eq!(
        std::fs::read(s.run_dir("good").join("result.json")).unwrap(),
        before
    );
    assert_eq!(s.status("good")["state"], "finished");
}

#[test]
fn a_read_only_store_and_a_full_disk_get_one_clear_line() {
    let ro = Tmpfs::mount("ro,size=64k");
    let s = Store::at(&ro.dir.join("root"));
    assert_eq!(
        stderr_line(&s.start("r1", &format!("sha256:{}", "a".repeat(64)), &[], &[])).trim_end(),
        format!(
            "fleet-run-supervisor: cannot create run \"r1\" in {}/root/runs: read-only file system",
            ro.dir.display()
        )
    );

    let full = Tmpfs::mount("size=64k");
    let s = Store::at(&full.dir);
    let p = s.script("echo fits");
    s.run("before", &p, &[]);
    assert_eq!(s.wait("before")["result"]["exit_code"], 0);
    // Fill the disk to the last byte.
    let _ = Command::new("dd")
        .args(["if=/dev/zero", "bs=4096", "status=none"])
        .arg(format!("of={}/filler", full.dir.display()))
        .stderr(std::process::Stdio::null())
        .status();
    let after = s.start("after", &p, &[], &[]);
    assert_eq!(refusal_code(&after), 7, "the disk-full status");
    assert_eq!(
        stderr_line(&after).trim_end(),
        format!(
            "fleet-run-supervisor: cannot create run \"after\" in {}/runs: no space left on device; free space on that disk and retry",
            full.dir.display()
        )
    );
    assert_eq!(s.status("before")["result"]["exit_code"], 0);
    assert!(!s.run_dir("after").exists());
}

/// The exit status of a command that must fail.
fn refusal_code(out: &Output) -> i32 {
    assert!(!out.status.success(), "expected a failure");
    out.status.code().expect("exited, not killed")
}

#[test]
fn an_input_too_large_for_the_disk_is_removed_and_its_run_reads_failed_not_lost() {
    let disk = Tmpfs::mount("size=256k");
    let s = Store::at(&disk.dir);
    let p = s.script("cat data");
    let tmp = tempdir();
    let big = tmp.path().join("big");
    std::fs::write(&big, vec![7u8; 1024 * 1024]).unwrap();
    let out = s.start(
        "big",
        &p,
        &["--input", &format!("data={}", big.display())],
        &[],
    );
    let reason = format!(
        "input \"data\" cannot be copied into run \"big\": no space left on device under {}; free space there or send a smaller input",
        disk.dir.display()
    );
    assert_eq!(refusal_code(&out), 7, "the disk-full status");
    assert_eq!(
        stderr_line(&out),
        format!("fleet-run-supervisor: {reason}\n")
    );
    // The partial copy is gone, and the record, written after it, says why.
    assert!(!s.run_dir("big").join("data").exists());
    let failed = s.status("big");
    assert_eq!(failed["state"], "failed");
    assert_eq!(failed["result"]["failure"]["step"], "input");
    assert_eq!(failed["result"]["failure"]["reason"], reason.as_str());
    // The disk has room again: the next run with a small input starts and reads it.
    let small = tmp.path().join("small");
    std::fs::write(&small, "small input\n").unwrap();
    s.run(
        "next",
        &p,
        &["--input", &format!("data={}", small.display())],
    );
    let done = s.wait("next");
    assert_eq!(done["result"]["exit_code"], 0);
    assert_eq!(done["stdout"]["first"], "small input\n");
}

#[test]
fn a_failure_record_that_does_not_fit_gives_the_claim_back_instead_of_reading_lost() {
    // Out of inodes rather than bytes: the claim (its folder) fits exactly, the input and
    // then the failure record do not.
    let disk = Tmpfs::mount("size=1m,nr_inodes=64");
    let s = Store::at(&disk.dir);
    let p = s.script("cat data");
    s.run("first", &p, &[]);
    s.wait("first");
    let fillers = disk.dir.join("fillers");
    std::fs::create_dir(&fillers).unwrap();
    let mut made = 0;
    while std::fs::File::create(fillers.join(made.to_string())).is_ok() {
        made += 1;
    }
    // Room for exactly the claim: its folder.
    std::fs::remove_file(fillers.join((made - 1).to_string())).unwrap();
    let tmp = tempdir();
    let input = tmp.path().join("in");
    std::fs::write(&input, "tiny\n").unwrap();
    let flag = format!("data={}", input.display());
    let out = s.start("tight", &p, &["--input", &flag], &[]);
    assert_eq!(refusal_code(&out), 7, "the disk-full status");
    assert_eq!(
        stderr_line(&out),
        format!(
            "fleet-run-supervisor: input \"data\" cannot be copied into run \"tight\": no space left on device under {}; free space there or send a smaller input (its failure record could not be written either: no space left on device; the run was removed, so its id can be started again)\n",
            disk.dir.display()
        )
    );
    // Never claimed-but-recordless: the id is unknown, not lost, and nothing lost is listed.
    let mut c = s.cmd();
    c.args(["status", "--run", "tight"]);
    let unknown = output(&mut c);
    assert_eq!(refusal_code(&unknown), 3, "the unknown-run status");
    let mut c = s.cmd();
    c.arg("list");
    assert!(!ok(&mut c).contains("lost"));
    // With room again the same id starts, once.
    std::fs::remove_dir_all(&fillers).unwrap();
    s.run("tight", &p, &["--input", &flag]);
    assert_eq!(s.wait("tight")["stdout"]["first"], "tiny\n");
}

#[test]
fn each_refusal_class_exits_with_its_own_documented_status() {
    let s = Store::new();
    let p = s.script("ln -s .. up");
    s.run("done", &p, &[]);
    s.wait("done");
    let code = |args: &[&str]| {
        let mut c = s.cmd();
        c.args(args);
        refusal_code(&output(&mut c))
    };
    let out = s.root.join("out");
    let out = out.to_str().unwrap();
    // Unknown run: 3, from every command that names one.
    for args in [
        &["status", "--run", "nope"][..],
        &["wait", "--run", "nope"],
        &["stop", "--run", "nope"],
        &["collect", "--run", "nope", "--path", "x", "--out", out],
    ] {
        assert_eq!(code(args), 3, "{args:?}");
    }
    // A run id started twice: 4.
    assert_eq!(refusal_code(&s.start("done", &p, &[], &[])), 4);
    // A program never staged: 5.
    let unknown = format!("sha256:{}", "0".repeat(64));
    assert_eq!(refusal_code(&s.start("r-unknown", &unknown, &[], &[])), 5);
    // A path that leaves the run folder: 6, whichever way it leaves.
    for path in ["../done/x", "/etc/passwd", "up/done/stdout"] {
        let args = ["collect", "--run", "done", "--path", path, "--out", out];
        assert_eq!(code(&args), 6, "{path}");
    }
    // Anything else: 1 (a bad run id, a missing file inside the run).
    assert_eq!(code(&["status", "--run", "a/b"]), 1);
    assert_eq!(
        code(&[
            "collect", "--run", "done", "--path", "missing", "--out", out
        ]),
        1
    );
}

/// The aarch64 musl build under qemu-aarch64-static: stage, start, timeout, status. Its child
/// is the host's own /bin/sleep: the emulator hands execve to the host kernel, which runs
/// x86_64 programs natively (an aarch64 child would need binfmt_misc, which is not set up).
#[test]
fn aarch64_build_runs_the_core_scenario_under_qemu() {
    let binary = testkit::target_dir()
        .join("aarch64-unknown-linux-musl/release")
        .join(BIN);
    assert!(
        binary.exists(),
        "{} is missing: run `cargo zigbuild --release --target aarch64-unknown-linux-musl -p fleet-run-supervisor` (cargo xtask ci does)",
        binary.display()
    );
    let tmp = tempdir();
    let root = tmp.path().join("root");
    let sup = || {
        let mut c = Command::new("qemu-aarch64-static");
        c.arg(&binary).arg("--root").arg(&root);
        c
    };
    let digest = ok(sup().args(["stage", "/bin/sleep"])).trim().to_string();
    assert_eq!(digest, sha256sum(Path::new("/bin/sleep")));
    // A timeout long enough for the emulated `status` below to find the run alive, loaded too.
    let out = ok(sup().args([
        "start",
        "--run",
        "arm",
        "--program",
        &digest,
        "--timeout",
        "5",
        "--grace",
        "2",
        "--",
        "100",
    ]));
    assert_eq!(out, "running\n");
    let v: Value =
        serde_json::from_str(&ok(sup().args(["status", "--run", "arm", "--json"]))).unwrap();
    assert_eq!(v["state"], "running");
    let v: Value =
        serde_json::from_str(&ok(sup().args(["wait", "--run", "arm", "--json"]))).unwrap();
    let r = &v["result"];
    assert_eq!(v["state"], "finished");
    assert_eq!(r["timed_out"], true);
    assert_eq!(r["signal"], 15);
    assert_eq!(r["killed"], false);
}

#[test]
fn staging_copies_a_program_once_and_repairs_a_damaged_copy() {
    use std::os::unix::fs::MetadataExt;
    let s = Store::new();
    let digest = s.stage(Path::new("/bin/true"));
    assert_eq!(digest, sha256sum(Path::new("/bin/true")));
    let staged = s
        .root
        .join("store/sha256")
        .join(digest.trim_start_matches("sha256:"));
    let first = std::fs::metadata(&staged).unwrap();
    assert_eq!(first.mode() & 0o777, 0o555);
    assert_eq!(s.stage(Path::new("/bin/true")), digest);
    assert_eq!(
        std::fs::metadata(&staged).unwrap().ino(),
        first.ino(),
        "copied once"
    );
    std::fs::write(&staged, "damaged").unwrap();
    assert_eq!(s.stage(Path::new("/bin/true")), digest);
    assert_eq!(sha256sum(&staged), digest, "the damaged copy was replaced");
    let mut c = s.cmd();
    c.args(["stage", "/nonexistent/prog"]);
    assert_eq!(
        fails(&mut c),
        "fleet-run-supervisor: cannot read /nonexistent/prog: no such file or directory\n"
    );
}

/// A relative `--root` once failed `start` with "cannot create stdout ...: no such file or
/// directory", because the detached supervisor runs in `/`; every command now resolves it
/// against the caller's folder.
#[test]
fn a_relative_root_no_longer_fails_start_with_cannot_create_stdout() {
    let cwd = tempdir();
    let relative = |args: &[&str]| {
        let mut c = testkit::cmd(BIN);
        c.current_dir(cwd.path())
            .args(["--root", "rel-root"])
            .args(args);
        c
    };
    std::fs::write(cwd.path().join("prog.sh"), "#!/bin/sh\necho \"out $PWD\"\n").unwrap();
    let p = ok(&mut relative(&["stage", "prog.sh"])).trim().to_string();
    assert_eq!(p, sha256sum(&cwd.path().join("prog.sh")));
    assert_eq!(
        ok(&mut relative(&["start", "--run", "rel", "--program", &p])),
        "running\n"
    );
    let v: Value =
        serde_json::from_str(&ok(&mut relative(&["wait", "--run", "rel", "--json"]))).unwrap();
    assert_eq!(v["state"], "finished");
    assert_eq!(v["result"]["exit_code"], 0);
    // The program sees its run folder by the path the supervisor resolved (getcwd's, canonical).
    let dir = std::fs::canonicalize(cwd.path())
        .unwrap()
        .join("rel-root/runs/rel");
    let collected = ok(&mut relative(&[
        "collect", "--run", "rel", "--path", "stdout", "--out", "got.txt",
    ]));
    let got = cwd.path().join("got.txt");
    assert_eq!(collected.trim(), sha256sum(&got));
    assert_eq!(
        std::fs::read_to_string(&got).unwrap(),
        format!("out {}\n", dir.display())
    );
    let mut empty = testkit::cmd(BIN);
    empty.args(["--root", "", "list"]);
    assert_eq!(
        fails(&mut empty),
        "fleet-run-supervisor: bad --root \"\": cannot make an empty path absolute; give the store folder's path\n"
    );
}
