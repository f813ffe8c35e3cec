//! The detached supervisor of one run: spawns the program without a shell, reads its output,
//! enforces the timeout on the whole tree, reaps everything, then writes result.json.
mod retention;
mod sink;
mod tree;
mod watch;

use crate::sys::{self, Ended, Reaped};
use run_store::layout::{OWNER_FILE, RESULT_FILE, STDERR_FILE, STDOUT_FILE};
use run_store::record::{FinalState, RunResult, SCHEMA};
use run_store::{Digest, Failure, Owner, Refusal, RunId, Step, Store, atomic, clock, describe_io};
use sink::Sink;
use std::ffi::OsString;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};
use tree::{Cgroup, Tree};
use watch::{Ready, Watch};

pub use sink::LAST_BYTES;

/// Everything a run needs, fixed by `start` before the supervisor detaches.
pub struct Plan {
    pub store: Store,
    pub id: RunId,
    pub digest: Digest,
    pub program: PathBuf,
    /// The full argv, argv[0] included.
    pub argv: Vec<OsString>,
    pub env: Vec<(OsString, OsString)>,
    pub timeout: Option<Duration>,
    pub grace: Duration,
    pub output_limit: u64,
    pub keep: usize,
    pub use_cgroup: bool,
    pub started: SystemTime,
    pub clock: Instant,
    /// The run's lock (see [`run_store::lock`]), let go once the result is durable.
    pub hold: Option<File>,
}

/// What the supervisor tells `start` over their channel: this, or a refusal as
/// [`report_refusal`] writes it.
pub const REPORT_OK: &[u8] = b"ok";
/// What `start` tells the supervisor once the claim is durable; anything else is the reason
/// it is not.
pub const CLAIM_DURABLE: &[u8] = b"go";

/// A refusal for the channel: its exit status, a space, then the line.
fn report_refusal(class: Refusal, line: &str) -> Vec<u8> {
    format!("{} {line}", class.code()).into_bytes()
}

/// Reads back what [`report_refusal`] wrote.
pub fn parse_refusal(report: &[u8]) -> (Refusal, String) {
    let text = String::from_utf8_lossy(report);
    match text.split_once(' ') {
        Some((code, line)) => match code.parse() {
            Ok(code) => (
                Refusal::from_code(Some(code)).unwrap_or(Refusal::Other),
                line.to_string(),
            ),
            Err(_) => (Refusal::Other, text.into_owned()),
        },
        None => (Refusal::Other, text.into_owned()),
    }
}

impl Plan {
    pub fn run_dir(&self) -> PathBuf {
        self.store.run_dir(&self.id)
    }

    /// A record with the run's fixed facts and no outcome yet.
    fn record(&self, state: FinalState) -> RunResult {
        RunResult {
            schema: SCHEMA,
            run: self.id.to_string(),
            program: self.digest.to_string(),
            argv: self
                .argv
                .iter()
                .map(|a| run_store::Bytes(a.as_bytes().to_vec()))
                .collect(),
            state,
            started: clock::rfc3339(self.started),
            ended: clock::rfc3339(SystemTime::now()),
            duration_s: self.clock.elapsed().as_secs_f64(),
            pid: None,
            exit_code: None,
            signal: None,
            timed_out: false,
            stopped: false,
            timeout_s: self.timeout.map(|t| t.as_secs_f64()),
            grace_s: self.grace.as_secs_f64(),
            grace_used_s: None,
            killed: false,
            containment: None,
            output_limit: self.output_limit,
            stdout: None,
            stderr: None,
            failure: None,
        }
    }

    /// Records that the run never started (durably, then applies retention) and returns the
    /// line `start` prints. The record is small, but the disk may still refuse it (filled again
    /// by someone else, or out of inodes). A claimed folder without a record would then read as
    /// `lost` forever, so instead the claim is given back: the folder is removed and the id
    /// reads as unknown. That loses nothing, since the program never ran, and a redelivered
    /// start simply tries again. The line says which of these happened.
    pub fn fail(&self, step: Step, reason: &str) -> String {
        let mut r = self.record(FinalState::Failed);
        r.failure = Some(Failure {
            step,
            reason: reason.to_string(),
        });
        let Err(e) = self.finish(&r, None) else {
            return reason.to_string();
        };
        let why = describe_io(&e);
        let dir = self.run_dir();
        let removed = retention::remove(&self.store, self.id.as_str().as_ref(), 0)
            // Where even the rename into tmp/ is refused, removing in place still beats a run
            // that reads as lost for good.
            .or_else(|_| std::fs::remove_dir_all(&dir));
        // Best effort: should the removal not survive a crash, the run reads as lost, which
        // is then the truth.
        let _ = atomic::sync_dir(&self.store.runs_dir());
        match removed {
            Err(e) if dir.exists() => format!(
                "{reason} (its failure record could not be written either: {why}, nor could the run be removed: {}; it reads as lost)",
                describe_io(&e)
            ),
            _ => format!(
                "{reason} (its failure record could not be written either: {why}; the run was removed, so its id can be started again)"
            ),
        }
    }

    /// Writes the record durably, lets go of the run's lock (`hold`), which wakes its waiters,
    /// then applies retention, so its work holds no waiter.
    fn finish(&self, r: &RunResult, hold: Option<File>) -> io::Result<()> {
        let json = serde_json::to_vec_pretty(r).map_err(io::Error::other)?;
        let marker = retention::mark(&self.store, &self.id)?;
        // Once the program was exec'd the owner file is done with: it becomes the record. A
        // crash midway leaves no result and a lock nobody holds, which reads as lost.
        if let Err(e) = atomic::write_over(&self.run_dir(), OWNER_FILE, RESULT_FILE, &json) {
            let _ = std::fs::remove_file(marker);
            return Err(e);
        }
        drop(hold);
        retention::prune(&self.store, self.keep);
        Ok(())
    }
}

/// Runs in the detached process: supervises the run to its end and returns the exit code.
pub fn supervise(mut plan: Plan, mut channel: UnixStream) -> i32 {
    // Writing to a `start` that has gone must not kill the supervisor.
    // SAFETY: setting a signal's disposition touches no Rust state.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    }
    let hold = plan.hold.take();
    match prepare_and_spawn(&plan, &mut channel) {
        Ok(running) => {
            let _ = channel.write_all(REPORT_OK);
            drop(channel);
            watch(&plan, running, hold)
        }
        Err((class, line)) => {
            let _ = channel.write_all(&report_refusal(class, &line));
            1
        }
    }
}

struct Running {
    tree: Tree,
    pid: libc::pid_t,
    signals: OwnedFd,
    out: Sink,
    err: Sink,
}

/// Everything up to the program's exec; an error is the line `start` prints, and its class.
fn prepare_and_spawn(plan: &Plan, channel: &mut UnixStream) -> Result<Running, (Refusal, String)> {
    let dir = plan.run_dir();
    let setup = |what: &str, e: io::Error| {
        let class = Refusal::of_io(&e);
        let message = format!(
            "cannot {what} for run {:?}: {}{}",
            plan.id.as_str(),
            describe_io(&e),
            class.advice()
        );
        (class, plan.fail(Step::Exec, &message))
    };
    let refused = |message: &str| (Refusal::Other, plan.fail(Step::Exec, message));
    // Emulators (qemu-user) refuse this; the cgroup then still finds the orphans.
    let subreaper = sys::set_child_subreaper().is_ok();
    let signals = sys::signalfd(sys::HANDLED).map_err(|e| setup("watch signals", e))?;
    let stdout = File::create(dir.join(STDOUT_FILE)).map_err(|e| setup("create stdout", e))?;
    let stderr = File::create(dir.join(STDERR_FILE)).map_err(|e| setup("create stderr", e))?;
    let cgroup = if plan.use_cgroup {
        Cgroup::create()
    } else {
        None
    };

    let argv: Vec<&[u8]> = plan.argv.iter().map(|a| a.as_bytes()).collect();
    let envp: Vec<Vec<u8>> = plan
        .env
        .iter()
        .map(|(k, v)| [k.as_bytes(), b"=", v.as_bytes()].concat())
        .collect();
    let Some(exec) = sys::Exec::new(plan.program.as_os_str().as_bytes(), &argv, &envp) else {
        let message = "an argument or --env value holds a NUL byte, which execve cannot pass";
        return Err(refused(message));
    };
    let dir_c = match std::ffi::CString::new(dir.as_os_str().as_bytes()) {
        Ok(d) => d,
        Err(_) => {
            return Err(refused("the run folder's path holds a NUL byte"));
        }
    };
    let place = sys::Placement {
        dir: &dir_c,
        cgroup_dir: cgroup.as_ref().map(Cgroup::dir_fd),
        cgroup_procs: cgroup.as_ref().map(Cgroup::procs_fd),
    };
    if let Err(why) = await_durable_claim(plan, channel) {
        return Err(refused(&why));
    }
    let spawned = match sys::spawn(&exec, &place) {
        Ok(spawned) => spawned,
        Err(e) => {
            let message = format!(
                "program {} cannot be executed: {}",
                plan.digest,
                describe_io(&e)
            );
            return Err(refused(&message));
        }
    };
    let pid = spawned.pid;
    let out = Sink::new(File::from(spawned.stdout), stdout, plan.output_limit);
    let err = Sink::new(File::from(spawned.stderr), stderr, plan.output_limit);
    // A reader now sees `running` with this process as the owner.
    if let Ok(owner) = Owner::for_self(pid as u32)
        && let Ok(json) = serde_json::to_vec(&owner)
    {
        let _ = atomic::write(&dir, OWNER_FILE, &json, false);
    }
    Ok(Running {
        tree: Tree {
            cgroup,
            leader: Some(pid),
            subreaper,
        },
        pid,
        signals,
        out,
        err,
    })
}

/// Waits for `start`'s word that the claim is durable; should `start` have died first, makes
/// it durable here.
fn await_durable_claim(plan: &Plan, channel: &mut UnixStream) -> Result<(), String> {
    let mut word = Vec::new();
    let _ = channel.read_to_end(&mut word);
    if word == CLAIM_DURABLE {
        return Ok(());
    }
    if !word.is_empty() {
        return Err(String::from_utf8_lossy(&word).into_owned());
    }
    make_claim_durable(&plan.store, &plan.id).map_err(|e| e.to_string())
}

/// The claim of a run could not be made durable: the line to report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimNotDurable(String);

impl std::fmt::Display for ClaimNotDurable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Flushes the rename that claimed `id`; the error is the line to report.
pub fn make_claim_durable(store: &Store, id: &RunId) -> Result<(), ClaimNotDurable> {
    make_claim_durable_line(store, id).map_err(ClaimNotDurable)
}

fn make_claim_durable_line(store: &Store, id: &RunId) -> Result<(), String> {
    let runs = store.runs_dir();
    atomic::sync_dir(&runs).map_err(|e| {
        format!(
            "cannot make the claim of run {:?} in {} durable: {}",
            id.as_str(),
            runs.display(),
            describe_io(&e)
        )
    })
}

fn watch(plan: &Plan, mut run: Running, hold: Option<File>) -> i32 {
    let mut machine = Watch::new(plan.timeout.map(|t| plan.clock + t), plan.grace);
    let mut live = Live {
        run: &mut run,
        buf: vec![0u8; 64 * 1024],
    };
    watch::drive(&mut machine, &mut live);
    let outcome = machine.outcome;

    let mut r = plan.record(FinalState::Finished);
    r.pid = Some(run.pid as u32);
    match outcome.ended {
        Some(Ended::Code(code)) => r.exit_code = Some(code),
        Some(Ended::Signal(signal)) => r.signal = Some(signal),
        None => {}
    }
    r.timed_out = outcome.timed_out();
    r.stopped = outcome.stopped();
    r.grace_used_s = outcome.grace_used.map(|g| g.as_secs_f64());
    r.killed = outcome.killed;
    r.containment = Some(run.tree.containment().to_string());
    r.stdout = Some(run.out.record());
    r.stderr = Some(run.err.record());
    // The cgroup goes before the record, so a finished run leaves nothing behind.
    drop(run.tree);
    match plan.finish(&r, hold) {
        Ok(()) => 0,
        // Nobody listens any more; the run reads as lost, which is the truth.
        Err(_) => 1,
    }
}

/// The real system under the watch: the run's tree, its signals and its pipes.
struct Live<'a> {
    run: &'a mut Running,
    buf: Vec<u8>,
}

impl watch::System for Live<'_> {
    fn now(&self) -> Instant {
        Instant::now()
    }

    fn signal_tree(&mut self, signal: libc::c_int) {
        self.run.tree.signal(signal);
    }

    fn tree_is_empty(&mut self) -> bool {
        self.run.tree.is_empty()
    }

    fn poll(&mut self, timeout: Option<Duration>) -> Ready {
        let timeout_ms = timeout.map_or(-1, |t| t.as_millis().clamp(1, i32::MAX as u128) as i32);
        let mut fds = vec![self.run.signals.as_raw_fd()];
        let open = [&self.run.out, &self.run.err]
            .map(|s| s.pipe.as_ref().map(|p| fds.push(p.as_raw_fd())).is_some());
        let ready = sys::poll_readable(&fds, timeout_ms).unwrap_or_else(|_| vec![true; fds.len()]);
        // Only open pipes were polled, in order, after the signals.
        let mut pipes = ready[1..].iter();
        Ready {
            signals: ready[0],
            pipes: open.map(|open| open && pipes.next() == Some(&true)),
        }
    }

    fn read_pipes(&mut self, ready: [bool; 2]) -> bool {
        for (ready, sink) in ready
            .into_iter()
            .zip([&mut self.run.out, &mut self.run.err])
        {
            if ready {
                sink.read_once(&mut self.buf);
            }
        }
        self.run.out.pipe.is_none() && self.run.err.pipe.is_none()
    }

    fn read_signal(&mut self) -> Option<libc::c_int> {
        sys::read_signal(&self.run.signals)
    }

    fn reap(&mut self) -> watch::Reaped {
        let mut reaped = watch::Reaped::default();
        loop {
            match sys::reap_any() {
                Reaped::One(pid, how) => {
                    if pid == self.run.pid {
                        reaped.leader = Some(how);
                        self.run.tree.leader = None;
                    }
                }
                Reaped::NoneYet => return reaped,
                Reaped::NoChildren => {
                    reaped.no_children = true;
                    return reaped;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Refusal, parse_refusal, report_refusal};

    #[test]
    fn a_refusal_survives_the_report_pipe_with_its_class() {
        let line = "cannot create stdout for run \"r\": no space left on device; free space";
        let report = report_refusal(Refusal::DiskFull, line);
        assert_eq!(
            parse_refusal(&report),
            (Refusal::DiskFull, line.to_string())
        );
        // Anything else (an older supervisor's bare line) is still shown, as class Other.
        assert_eq!(
            parse_refusal(b"exec failed: x"),
            (Refusal::Other, "exec failed: x".to_string())
        );
    }
}
