//! The node's work: each command executed against the runtime and recorded in the node's store
//! before it is answered, so a redelivered command is answered from the record, never redone.
use crate::runtime::{RunReport, RunSpec, RunState, Runtime, RuntimeError, Started};
use crate::state::{StateError, Store};
use base64::Engine;
use fleet_proto::Digest;
use fleet_proto::protocol::{Answer, Command, Refusal, RefusalClass, Reply, StartRun};
use serde_json::json;
use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// The largest file a collect carries back in one message.
pub const MAX_COLLECT: u64 = 8 << 20;
const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

static STAGES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Temporary files of the node under its state folder: programs being staged, inputs, collects.
pub fn scratch_dir(state: &Path) -> PathBuf {
    state.join("scratch")
}

/// The node's durable store and its runtime.
pub struct Node {
    pub store: Arc<Store>,
    pub runtime: Arc<dyn Runtime>,
    /// Temporary files (programs being staged, inputs, collected files); never secrets.
    scratch: PathBuf,
}

impl Node {
    pub fn open(state: &Path, runtime: Arc<dyn Runtime>) -> Result<Node, StateError> {
        let store = Arc::new(Store::open(state)?);
        let scratch = scratch_dir(state);
        let _ = std::fs::remove_dir_all(&scratch);
        Ok(Node {
            store,
            runtime,
            scratch,
        })
    }

    /// Answers one command (blocking). Fenced by `generation`; mutating commands are answered
    /// from the applied record when redelivered, and recorded before the answer leaves. A run
    /// that could not start is logged at warning level with its reason (a full disk, a missing
    /// program), since nobody watches the machine.
    pub fn execute(&self, op: &str, generation: u64, command: &Command) -> Answer {
        let answer = self.answer(op, generation, command);
        if let (Command::Start(start), Err(refusal)) = (command, &answer) {
            tracing::warn!(op, run_id = %start.run_id, "a run could not start: {}", refusal.message);
        }
        answer
    }

    fn answer(&self, op: &str, generation: u64, command: &Command) -> Answer {
        let store_failed = |e: StateError| Refusal::new(RefusalClass::Store, e);
        if let Err(e) = self.store.check_generation(generation) {
            return Err(Refusal::new(RefusalClass::Fenced, e));
        }
        if command.mutates() {
            match self.store.applied(op) {
                Ok(Some(recorded)) => {
                    return serde_json::from_value(recorded).unwrap_or_else(|e| {
                        Err(Refusal::new(
                            RefusalClass::Store,
                            format!("the recorded answer of {op} does not parse ({e}); run the agent version that wrote it"),
                        ))
                    });
                }
                Ok(None) => {}
                Err(e) => return Err(store_failed(e)),
            }
        }
        let answer = match command {
            Command::Stage {
                digest,
                program_b64,
            } => self.stage(digest, program_b64),
            Command::Start(start) => self.start(op, start),
            Command::Stop { run_id } => self
                .runtime
                .stop(run_id)
                .map(|()| Reply::Stopped {
                    run_id: run_id.clone(),
                })
                .map_err(refused),
            Command::Status { run_id } => self
                .runtime
                .status(run_id)
                .map(|s| Reply::Status {
                    run_id: s.run_id,
                    state: s.state,
                    report: s.report,
                })
                .map_err(refused),
            Command::Collect { run_id, path } => self.collect(run_id, path),
            Command::Facts => Err(Refusal::new(
                RefusalClass::Other,
                "facts are answered by the session",
            )),
        };
        if command.mutates() {
            let recorded = serde_json::to_value(&answer).expect("answers serialize");
            if let Err(e) = self.store.record_applied(op, &recorded) {
                return Err(store_failed(e));
            }
        }
        answer
    }

    fn scratch_file(&self, name: &str) -> Result<PathBuf, String> {
        std::fs::create_dir_all(&self.scratch)
            .map_err(|e| format!("cannot create {}: {e}", self.scratch.display()))?;
        Ok(self.scratch.join(name))
    }

    fn stage(&self, digest: &Digest, program_b64: &str) -> Answer {
        let other = |m: String| Refusal::new(RefusalClass::Other, m);
        let Ok(bytes) = B64.decode(program_b64) else {
            return Err(other(format!("stage {digest}: the program is not base64")));
        };
        // Stages run side by side, so each gets a file of its own.
        let n = STAGES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let file = self
            .scratch_file(&format!("stage-{}-{n}", std::process::id()))
            .map_err(other)?;
        if let Err(e) = std::fs::write(&file, &bytes) {
            return Err(other(format!(
                "stage {digest}: cannot write the program: {e}"
            )));
        }
        let staged = self.runtime.stage(&file);
        let _ = std::fs::remove_file(&file);
        match staged {
            Ok(got) if got == *digest => Ok(Reply::Staged { digest: got }),
            Ok(got) => Err(Refusal::new(
                RefusalClass::NotStaged,
                format!("stage {digest}: the bytes sent hash to {got}; resend the program"),
            )),
            Err(e) => Err(refused(e)),
        }
    }

    fn start(&self, op: &str, start: &StartRun) -> Answer {
        let run_id = &start.run_id;
        let store_failed = |e: StateError| Refusal::new(RefusalClass::Store, e);
        // A run id belongs to the first operation that used it; another one is a duplicate.
        let claim = format!("run-claim:{run_id}");
        match self.store.applied(&claim) {
            Ok(Some(c)) if c["op"] != op => {
                return Err(Refusal::new(
                    RefusalClass::RunIdTaken,
                    format!(
                        "run {run_id}: the run id is already used on this node; start it under a new run id"
                    ),
                ));
            }
            Ok(Some(_)) => {}
            Ok(None) => {
                if let Err(e) = self.store.record_applied(&claim, &json!({ "op": op })) {
                    return Err(store_failed(e));
                }
            }
            Err(e) => return Err(store_failed(e)),
        }
        let inputs = match self.write_inputs(start) {
            Ok(i) => i,
            Err(e) => {
                return self.fail_run(start, Refusal::new(RefusalClass::Other, e));
            }
        };
        if let Err(e) = self.store.track_run(run_id, &start.workload) {
            return Err(store_failed(e));
        }
        let spec = RunSpec {
            run_id: run_id.clone(),
            workload: start.workload.clone(),
            argv: start
                .options
                .argv
                .iter()
                .map(|a| OsString::from_vec(a.0.clone()))
                .collect(),
            timeout: start.options.timeout_ms.map(Duration::from_millis),
            grace: None,
            output_limit: start.options.output_limit,
            env: start.options.env.clone(),
            inputs,
            resources: start.options.resources.clone(),
            registry_auth: start.registry_auth.clone(),
        };
        let started = self.runtime.start(&spec);
        if let Some(dir) = spec.inputs.first().and_then(|(_, p)| p.parent()) {
            let _ = std::fs::remove_dir_all(dir);
        }
        match started {
            Ok(started) => Ok(Reply::Started {
                run_id: run_id.clone(),
                already: started == Started::Already,
            }),
            Err(e) => self.fail_run(start, refused(e)),
        }
    }

    /// A start that could not launch: the run is recorded `failed` with the reason, once.
    fn fail_run(&self, start: &StartRun, refusal: Refusal) -> Answer {
        let run_id = &start.run_id;
        let recorded = self.store.track_run(run_id, &start.workload).and_then(|_| {
            self.store.transition(
                run_id,
                RunState::Failed,
                RunReport::error(refusal.message.clone()),
            )
        });
        match recorded {
            Ok(_) => Err(refusal),
            Err(e) => Err(Refusal::new(RefusalClass::Store, e)),
        }
    }

    fn write_inputs(&self, start: &StartRun) -> Result<Vec<(String, PathBuf)>, String> {
        let mut out = Vec::new();
        for (name, content) in &start.options.inputs {
            if name.is_empty() || name.contains('/') || name == "." || name == ".." {
                return Err(format!(
                    "run {}: input name {name:?} must be a plain file name",
                    start.run_id
                ));
            }
            let bytes = B64
                .decode(content)
                .map_err(|_| format!("run {}: input {name} is not base64", start.run_id))?;
            let dir = self.scratch_file(&format!("inputs-{}", start.run_id))?;
            std::fs::create_dir_all(&dir)
                .map_err(|e| format!("run {}: cannot write input {name}: {e}", start.run_id))?;
            let path = dir.join(name);
            std::fs::write(&path, bytes).map_err(|e| match e.raw_os_error() {
                Some(28) => format!("run {}: input {name} does not fit on the disk ({e}); free space or send a smaller input", start.run_id),
                _ => format!("run {}: cannot write input {name}: {e}", start.run_id),
            })?;
            out.push((name.clone(), path));
        }
        Ok(out)
    }

    fn collect(&self, run_id: &str, path: &str) -> Answer {
        let mut bytes = Vec::new();
        let collected = self
            .runtime
            .collect(run_id, path, MAX_COLLECT, &mut bytes)
            .map_err(refused)?;
        Ok(Reply::Collected {
            digest: collected.digest,
            content_b64: B64.encode(bytes),
        })
    }
}

/// A runtime error as the refusal the coordinator reads.
fn refused(e: RuntimeError) -> Refusal {
    Refusal::new(e.class(), e)
}
