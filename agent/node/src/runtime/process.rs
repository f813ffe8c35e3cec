//! [`ProcessRuntime`]: runs programs through the `fleet-run-supervisor` command line, one short
//! child process per call, so runs are detached from the agent and survive its restarts.
use super::{
    Collected, CollectedFile, Outcome, RunReport, RunSpec, RunState, RunStatus, Runtime,
    RuntimeError, Started, Workload,
};
use fleet_proto::Digest;
use fleet_proto::RunId;
use fleet_proto::run::OutputEnd;
use run_store::Refusal;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

/// The supervisor's file name, shipped beside `fleet-agent`.
pub const SUPERVISOR_NAME: &str = "fleet-run-supervisor";
/// The run store used when none is given (the run store's own default).
pub use run_store::layout::DEFAULT_ROOT;

/// Drives `fleet-run-supervisor --root ROOT ...`.
#[derive(Debug, Clone)]
pub struct ProcessRuntime {
    supervisor: PathBuf,
    root: PathBuf,
}

impl ProcessRuntime {
    /// A runtime using the supervisor at `supervisor` and the run store at `root`.
    pub fn new(supervisor: impl Into<PathBuf>, root: impl Into<PathBuf>) -> ProcessRuntime {
        ProcessRuntime {
            supervisor: supervisor.into(),
            root: root.into(),
        }
    }

    /// A runtime using the supervisor shipped beside the running executable.
    pub fn beside_current_exe(root: impl Into<PathBuf>) -> Result<ProcessRuntime, RuntimeError> {
        let exe = std::env::current_exe().map_err(|e| RuntimeError::Spawn {
            path: PathBuf::from(SUPERVISOR_NAME),
            reason: format!(
                "cannot find the agent's own executable: {}",
                run_store::describe_io(&e)
            ),
        })?;
        let dir = exe.parent().unwrap_or(Path::new("/"));
        Ok(ProcessRuntime::new(dir.join(SUPERVISOR_NAME), root))
    }

    /// The supervisor binary this runtime runs.
    pub fn supervisor(&self) -> &Path {
        &self.supervisor
    }

    /// The run store this runtime uses.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The run store's reader: status and listing read the store's files in-process (the format
    /// is the supervisor's library), saving a child process per run on every watch.
    fn store(&self) -> run_store::Store {
        run_store::Store::new(&self.root)
    }

    /// Runs one supervisor command to completion and returns its output, whatever its exit status.
    fn call(&self, args: &[OsString]) -> Result<Output, RuntimeError> {
        Command::new(&self.supervisor)
            .arg("--root")
            .arg(&self.root)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| RuntimeError::Spawn {
                path: self.supervisor.clone(),
                reason: run_store::describe_io(&e),
            })
    }

    /// Like [`call`](Self::call), but a failure becomes the supervisor's refusal class (from its
    /// exit status) and its one-line reason.
    fn call_ok(&self, args: &[OsString]) -> Result<String, Failure> {
        let out = self.call(args).map_err(Failure::Runtime)?;
        match Refusal::from_code(out.status.code()) {
            None => Ok(String::from_utf8_lossy(&out.stdout).into_owned()),
            Some(class) => Err(Failure::Said {
                class,
                reason: reason(&out),
            }),
        }
    }
}

/// A failed supervisor call: either it could not run, or it ran and refused.
///
/// The supervisor exits with a distinct status per refusal class (`run_store::exit`, documented
/// in docs/supervisor.md), so the class comes from the status and the wording stays free for
/// people; `tests/it/agent_runtime.rs` pins each mapping against the real binary.
enum Failure {
    Runtime(RuntimeError),
    Said { class: Refusal, reason: String },
}

impl Failure {
    /// Turns a refusal for `run_id` into the matching per-run error.
    fn for_run(self, run_id: &RunId) -> RuntimeError {
        let (class, reason) = match self {
            Failure::Runtime(e) => return e,
            Failure::Said { class, reason } => (class, reason),
        };
        let run_id = run_id.clone();
        match class {
            Refusal::DiskFull => RuntimeError::NoSpace {
                run_id,
                detail: reason,
            },
            Refusal::UnknownRun => RuntimeError::UnknownRun { run_id },
            _ => RuntimeError::Refused { run_id, reason },
        }
    }

    fn for_task(self, what: &str) -> RuntimeError {
        match self {
            Failure::Runtime(e) => e,
            Failure::Said { reason, .. } => RuntimeError::Failed {
                what: what.to_string(),
                reason,
            },
        }
    }
}

/// The supervisor's reason for a failure: the last line it wrote to stderr, without its name.
fn reason(out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr);
    let line = stderr
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("")
        .trim();
    let line = line
        .strip_prefix(SUPERVISOR_NAME)
        .map(|l| l.trim_start_matches(':').trim_start())
        .unwrap_or(line);
    let line = line
        .strip_prefix("error:")
        .map(str::trim_start)
        .unwrap_or(line);
    if line.is_empty() {
        format!("the supervisor exited with {} and said nothing", out.status)
    } else {
        line.to_string()
    }
}

impl Runtime for ProcessRuntime {
    fn held(&self) -> super::Held {
        // Staged programs lie as a blob store does: `store/sha256/HEX`.
        let programs =
            fleet_content::Blobs::new(self.store().programs_dir().parent().unwrap_or(&self.root));
        super::Held {
            digests: programs
                .list()
                .unwrap_or_default()
                .into_iter()
                .map(|(d, _)| d)
                .collect(),
            images: 0,
        }
    }

    fn stage(&self, file: &Path) -> Result<Digest, RuntimeError> {
        let stage = run_store::cli::Command::Stage { file: file.into() };
        let out = self
            .call_ok(&stage.to_args())
            .map_err(|f| f.for_task(&format!("staging {}", file.display())))?;
        digest_line(&out, "stage")
    }

    fn start(&self, spec: &RunSpec) -> Result<Started, RuntimeError> {
        let unsupported = |what: &str, hint| RuntimeError::Unsupported {
            run_id: spec.run_id.clone(),
            what: what.to_string(),
            runtime: "process",
            hint,
        };
        let program = match &spec.workload {
            Workload::Program(digest) => digest,
            Workload::Image(_) => {
                return Err(unsupported(
                    "an image",
                    "run images on a node with the container runtime",
                ));
            }
        };
        if !spec.resources.is_default() {
            return Err(unsupported(
                "a CPU, memory or GPU request",
                "the supervisor enforces only the timeout and output limit; run it as an image",
            ));
        }
        let run_id = &spec.run_id;
        // The supervisor's command line is built by its own library, which also parses it.
        let mut start = run_store::cli::Start::new(run_id, program, spec.argv.iter().cloned());
        start.timeout = spec.timeout;
        start.grace = spec.grace;
        start.output_limit = spec.output_limit;
        start.env = spec.env.iter().map(|(k, v)| (k.into(), v.into())).collect();
        start.inputs = spec.inputs.clone();
        let args = run_store::cli::Command::Start(start).to_args();
        match self.call_ok(&args) {
            Ok(_) => Ok(Started::New),
            // The supervisor's run-id claim: this start (or a redelivery of it) already happened.
            Err(Failure::Said {
                class: Refusal::RunExists,
                ..
            }) => Ok(Started::Already),
            Err(Failure::Said {
                class: Refusal::NotStaged,
                ..
            }) => Err(RuntimeError::UnknownProgram {
                run_id: spec.run_id.clone(),
                program: program.to_string(),
            }),
            Err(f) => Err(f.for_run(&spec.run_id)),
        }
    }

    fn stop(&self, run_id: &RunId) -> Result<(), RuntimeError> {
        let stop = run_store::cli::Command::Stop {
            run: run_id.to_string(),
        };
        self.call_ok(&stop.to_args())
            .map(drop)
            .map_err(|f| f.for_run(run_id))
    }

    fn status(&self, run_id: &RunId) -> Result<RunStatus, RuntimeError> {
        match self.store().status(run_id) {
            Ok(status) => Ok(convert(status)),
            Err(run_store::Error::UnknownRun { .. }) => Err(RuntimeError::UnknownRun {
                run_id: run_id.clone(),
            }),
            Err(e) => Err(RuntimeError::Refused {
                run_id: run_id.clone(),
                reason: e.to_string(),
            }),
        }
    }

    fn collect(
        &self,
        run_id: &RunId,
        path: &str,
        max_bytes: u64,
        mut sink: &mut dyn std::io::Write,
    ) -> Result<Collected, RuntimeError> {
        let mut collected = self.open_collected(run_id, path, max_bytes, Path::new(""))?;
        let (digest, size) =
            fleet_content::copy_hashing(&mut collected.file, &mut sink).map_err(|e| {
                RuntimeError::Refused {
                    run_id: run_id.clone(),
                    reason: format!("cannot send the collected {path}: {e}"),
                }
            })?;
        Ok(Collected { digest, size })
    }

    /// The run's own file, opened without leaving its folder: no copy (`scratch` is unused).
    fn open_collected(
        &self,
        run_id: &RunId,
        path: &str,
        max_bytes: u64,
        _scratch: &Path,
    ) -> Result<CollectedFile, RuntimeError> {
        self.status(run_id)?;
        let file =
            run_store::inside::open_in_run(&self.store(), run_id, path.as_ref()).map_err(|e| {
                match e {
                    run_store::inside::OpenError::Escapes(_) => RuntimeError::PathEscapes {
                        run_id: run_id.clone(),
                        path: path.to_string(),
                    },
                    e => RuntimeError::Refused {
                        run_id: run_id.clone(),
                        reason: e.to_string(),
                    },
                }
            })?;
        let size = (file.metadata())
            .map_err(|e| RuntimeError::Refused {
                run_id: run_id.clone(),
                reason: format!("cannot read the collected {path}: {e}"),
            })?
            .len();
        if size > max_bytes {
            return Err(RuntimeError::TooLarge {
                run_id: run_id.clone(),
                path: path.to_string(),
                size,
                limit: max_bytes,
            });
        }
        Ok(CollectedFile::in_place(file, size))
    }

    fn list(&self) -> Result<Vec<RunStatus>, RuntimeError> {
        let runs = self.store().list().map_err(|e| RuntimeError::Failed {
            what: "listing runs".into(),
            reason: e.to_string(),
        })?;
        Ok(runs.into_iter().map(convert).collect())
    }
}

/// The run store's state as the protocol's.
fn state_of(state: run_store::State) -> RunState {
    {
        match state {
            run_store::State::Starting => RunState::Starting,
            run_store::State::Running => RunState::Running,
            run_store::State::Finished => RunState::Finished,
            run_store::State::Failed => RunState::Failed,
            run_store::State::Lost => RunState::Lost,
        }
    }
}

/// The run store's view of a run: the typed outcome and failure from `result.json`, and the
/// supervisor's records as the opaque detail.
fn convert(status: run_store::RunStatus) -> RunStatus {
    let detail = serde_json::json!({
        "run": status.id.as_str(),
        "state": status.state.as_str(),
        "owner": status.owner,
        "result": status.result,
    });
    let result = status.result.as_ref();
    let error = match (status.state, result) {
        (_, Some(r)) => r
            .failure
            .as_ref()
            .map(|f| format!("{}: {}", f.step.as_str(), f.reason)),
        (run_store::State::Lost, None) => {
            Some("the supervisor died before recording how the run ended".into())
        }
        _ => None,
    };
    RunStatus {
        run_id: status.id.clone(),
        state: state_of(status.state),
        report: RunReport {
            outcome: result.map(outcome),
            error,
            detail,
        },
    }
}

/// `result.json` read as the runtime-neutral outcome.
fn outcome(r: &run_store::RunResult) -> Outcome {
    let end = |s: &Option<run_store::StreamRecord>| {
        s.as_ref().and_then(|s| {
            Some(OutputEnd {
                bytes: s.bytes,
                kept: s.kept,
                truncated: s.truncated,
                sha256: Digest::parse(&s.sha256).ok()?,
                last: s.last.clone(),
            })
        })
    };
    Outcome {
        exit_code: r.exit_code,
        signal: r.signal,
        timed_out: r.timed_out,
        stopped: r.stopped,
        // Neither cgroup v1 nor a process group tells the supervisor why the kernel killed a program.
        oom_killed: None,
        stdout: end(&r.stdout),
        stderr: end(&r.stderr),
        started_at: Some(r.started.clone()),
        ended_at: Some(r.ended.clone()),
    }
}

/// The `sha256:HEX` line a command prints on success.
fn digest_line(stdout: &str, what: &str) -> Result<Digest, RuntimeError> {
    let line = stdout.trim();
    Digest::parse(line).map_err(|_| protocol(what, format!("expected sha256:HEX, got {line:?}")))
}

fn protocol(what: &str, reason: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Protocol {
        what: what.to_string(),
        reason: reason.to_string(),
    }
}
