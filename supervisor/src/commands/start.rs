//! `start`: claims the run id, checks the program and inputs, then forks the detached
//! supervisor and returns once the program was exec'd (or refused), printing the state.
use super::{io_line, refuse};
use crate::supervise::{self, Plan, REPORT_OK};
use crate::sys::{self, Forked};
use anyhow::{Result, anyhow, bail};
use run_store::cli::Start;
use run_store::layout::{RESERVED_NAMES, STDOUT_FILE};
use run_store::{Digest, Refusal, RunId, Step, Store, atomic, describe_io, lock};
use std::ffi::OsString;
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime};

/// The environment every program gets before `--env` (never the caller's).
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

pub fn run(store: &Store, start: Start) -> Result<i32> {
    let (started, clock) = (SystemTime::now(), Instant::now());
    let id = RunId::parse(&start.run)?;
    // The supervisor names a bad digest as the program's (`Error::BadDigest`).
    let digest = Digest::parse(&start.program).map_err(run_store::Error::from)?;
    check_inputs(&start.inputs)?;
    let hold = claim(store, &id)?;

    let dir = store.run_dir(&id);
    let program = store.program_path(&digest);
    let (grace, output_limit, keep) = (
        start.grace_or_default(),
        start.output_limit_or_default(),
        start.keep_or_default(),
    );
    let argv = std::iter::once(program.clone().into_os_string())
        .chain(start.args)
        .collect();
    let plan = Plan {
        store: store.clone(),
        env: environment(&dir, &id, start.env),
        id,
        digest,
        program,
        argv,
        timeout: start.timeout,
        grace,
        output_limit,
        keep,
        use_cgroup: !start.no_cgroup,
        started,
        clock,
        hold: Some(hold),
    };
    if let Err(e) = verify(&plan).and_then(|()| copy_inputs(&plan, &start.inputs)) {
        let line = plan.fail(e.step, &e.line);
        // What start reports stays true after a crash, refusals included.
        let _ = atomic::sync_dir(&store.runs_dir());
        return Err(refuse(e.class, line));
    }
    detach(plan)
}

/// Input names are plain file names in the run folder that do not shadow its record.
fn check_inputs(inputs: &[(String, PathBuf)]) -> Result<()> {
    for (n, (name, _)) in inputs.iter().enumerate() {
        let plain = name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
        if !plain || name.is_empty() || name.len() > 255 || name == "." || name == ".." {
            bail!("bad input name {name:?}: use a file name of A-Z a-z 0-9 . _ -");
        }
        if RESERVED_NAMES.contains(&name.as_str()) {
            bail!("bad input name {name:?}: the run's own {name} lives there");
        }
        if inputs[..n].iter().any(|(other, _)| other == name) {
            bail!("bad input name {name:?}: given twice");
        }
    }
    Ok(())
}

/// The atomic claim: the run folder is made in tmp/ and locked (see [`run_store::lock`]), then
/// renamed into runs/ unless the id exists, so a reader never sees a run nobody holds. The
/// lock is returned, to be kept until the result is durable; the claim is made durable in
/// [`detach`], before the program runs.
fn claim(store: &Store, id: &RunId) -> Result<File> {
    let runs = store.runs_dir();
    let cannot = || format!("cannot create run {:?} in {}", id.as_str(), runs.display());
    fs::create_dir_all(&runs).map_err(io_line(cannot()))?;
    let tmp = store.tmp_dir();
    fs::create_dir_all(&tmp).map_err(io_line(cannot()))?;
    let staging = tmp.join(format!("claim-{}-{}", id, std::process::id()));
    let _ = fs::remove_dir_all(&staging);
    let built = fs::create_dir(&staging)
        .and_then(|()| lock::hold(&staging))
        .and_then(|hold| room_for_records(&hold).map(|()| hold))
        .and_then(|hold| move_into_place(&staging, &store.run_dir(id)).map(|()| hold));
    match built {
        Ok(hold) => Ok(hold),
        Err(e) => {
            let _ = fs::remove_dir_all(&staging);
            if matches!(e.raw_os_error(), Some(libc::EEXIST) | Some(libc::ENOTEMPTY)) {
                return Err(refuse(
                    Refusal::RunExists,
                    format!(
                        "run {:?} already exists in {}: a run id is started at most once",
                        id.as_str(),
                        runs.display()
                    ),
                ));
            }
            Err(io_line(cannot())(e))
        }
    }
}

/// Renames the claim into runs/ unless the id is taken. Where the filesystem lacks
/// RENAME_NOREPLACE, a plain rename would replace a claimed folder that is still empty, so
/// ours gets its `stdout` first and the rename then fails on any other claim, never empty.
fn move_into_place(staging: &Path, run_dir: &Path) -> io::Result<()> {
    match sys::rename_noreplace(staging, run_dir) {
        Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOSYS)) => {
            File::create(staging.join(STDOUT_FILE))?;
            fs::rename(staging, run_dir)
        }
        moved => moved,
    }
}

/// Bytes a run needs for its own records (owner, result, retention marker) whatever the
/// program writes; with less free, a run would start only to end unrecorded.
const RECORD_ROOM: u64 = 16 * 1024;

fn room_for_records(folder: &File) -> io::Result<()> {
    if sys::available_bytes(folder)? < RECORD_ROOM {
        return Err(io::Error::from_raw_os_error(libc::ENOSPC));
    }
    Ok(())
}

/// The clean default environment, then `--env` (a later value for a name wins).
fn environment(
    dir: &Path,
    id: &RunId,
    extra: Vec<(OsString, OsString)>,
) -> Vec<(OsString, OsString)> {
    let mut env: Vec<(OsString, OsString)> = vec![
        ("PATH".into(), DEFAULT_PATH.into()),
        ("HOME".into(), dir.as_os_str().to_owned()),
        ("LANG".into(), "C.UTF-8".into()),
        ("FLEET_RUN_ID".into(), id.as_str().into()),
    ];
    for (k, v) in extra {
        env.retain(|(old, _)| *old != k);
        env.push((k, v));
    }
    env
}

/// A step that refused the start: which one, the line (also the record's reason), and the
/// exit status class.
struct StepError {
    step: Step,
    line: String,
    class: Refusal,
}

impl StepError {
    fn new(step: Step, line: String) -> Self {
        Self {
            step,
            line,
            class: Refusal::Other,
        }
    }
}

/// The staged bytes still hash to their name.
fn verify(plan: &Plan) -> Result<(), StepError> {
    let root = plan.store.root().display();
    let file = match File::open(&plan.program) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(StepError {
                step: Step::Stage,
                line: format!(
                    "program {} is not staged in {root}: run `fleet-run-supervisor stage FILE` first",
                    plan.digest
                ),
                class: Refusal::NotStaged,
            });
        }
        Err(e) => return Err(verify_error(plan, &e)),
    };
    let actual = Digest::of_reader(file).map_err(|e| verify_error(plan, &e))?;
    if actual != plan.digest {
        return Err(StepError::new(
            Step::Verify,
            format!(
                "program {} in {root} no longer matches its digest (its bytes hash to {actual}): stage it again",
                plan.digest
            ),
        ));
    }
    Ok(())
}

fn verify_error(plan: &Plan, e: &io::Error) -> StepError {
    let reason = describe_io(e);
    StepError::new(
        Step::Verify,
        format!("cannot read program {}: {reason}", plan.digest),
    )
}

/// Copies each `--input` into the run folder. On a refusal the inputs copied so far, the
/// partial one included, are removed first: the run will never start, and on a full disk that
/// room is what its failure record and the next run need.
fn copy_inputs(plan: &Plan, inputs: &[(String, PathBuf)]) -> Result<(), StepError> {
    let dir = plan.run_dir();
    for (n, (name, path)) in inputs.iter().enumerate() {
        if let Err(e) = copy_input(plan, &dir.join(name), name, path) {
            for (copied, _) in &inputs[..=n] {
                let _ = fs::remove_file(dir.join(copied));
            }
            return Err(e);
        }
    }
    Ok(())
}

fn copy_input(plan: &Plan, dst: &Path, name: &str, path: &Path) -> Result<(), StepError> {
    let unreadable = |reason: String| {
        let path = path.display();
        StepError::new(
            Step::Input,
            format!("input {name:?} cannot be read from {path}: {reason}"),
        )
    };
    let mut src = File::open(path).map_err(|e| unreadable(describe_io(&e)))?;
    match src.metadata() {
        Ok(m) if m.is_file() => {}
        Ok(_) => return Err(unreadable("it is not a regular file".to_string())),
        Err(e) => return Err(unreadable(describe_io(&e))),
    }
    let copied = File::create(dst).and_then(|mut dst| io::copy(&mut src, &mut dst));
    copied.map(drop).map_err(|e| {
        let (id, reason) = (plan.id.as_str(), describe_io(&e));
        let class = Refusal::of_io(&e);
        let line = match class {
            Refusal::DiskFull => format!(
                "input {name:?} cannot be copied into run {id:?}: {reason} under {}; free space there or send a smaller input",
                plan.store.root().display()
            ),
            _ => format!("input {name:?} cannot be copied into run {id:?}: {reason}"),
        };
        StepError {
            step: Step::Input,
            line,
            class,
        }
    })
}

/// Forks the supervisor into its own session (reparented away from the caller once `start`
/// exits) and waits for its word that the program was exec'd or refused. One fork, not two:
/// the supervisor never opens a terminal, so being a session leader costs nothing, and each
/// extra process hop is a scheduling delay on a busy machine.
///
/// While the supervisor prepares the program (output files, cgroup), this process makes the
/// claim durable and then tells it to go on: the flush overlaps that work, yet a redelivered
/// start after a crash is still refused, since nothing runs before the claim is on disk.
fn detach(plan: Plan) -> Result<i32> {
    let (store, id) = (plan.store.clone(), plan.id.clone());
    let (mut ours, theirs) =
        UnixStream::pair().map_err(io_line("cannot create the supervisor's channel"))?;
    match sys::fork().map_err(io_line("cannot fork the supervisor"))? {
        Forked::Child => {
            drop(ours);
            let _ = sys::setsid();
            let hold = plan.hold.as_ref().map_or(-1, |h| h.as_raw_fd());
            let _ = sys::detach_fds(&[theirs.as_raw_fd(), hold]);
            let _ = std::env::set_current_dir("/");
            std::process::exit(supervise::supervise(plan, theirs));
        }
        Forked::Parent(_) => {
            drop(theirs);
            // The supervisor holds the run now; this copy of the lock must not outlive it.
            drop(plan);
            let word = match supervise::make_claim_durable(&store, &id) {
                Ok(()) => supervise::CLAIM_DURABLE.to_vec(),
                Err(line) => line.to_string().into_bytes(),
            };
            // A supervisor that already refused has gone; its report says why.
            let _ = ours.write_all(&word);
            let _ = ours.shutdown(Shutdown::Write);
            let mut report = Vec::new();
            let _ = ours.read_to_end(&mut report);
            if report == REPORT_OK {
                println!("running");
                return Ok(0);
            }
            if report.is_empty() {
                return Err(anyhow!(
                    "the supervisor of run {:?} died before the program started: the run reads as lost",
                    id.as_str()
                ));
            }
            let (class, line) = supervise::parse_refusal(&report);
            Err(refuse(class, line))
        }
    }
}
