//! The node's work: each command executed against the runtime and recorded in the node's store
//! before it is answered, so a redelivered command is answered from the record, never redone.
use crate::protocol::{Command, StartRun, error, ok};
use crate::runtime::{RunSpec, RunState, Runtime, Started};
use crate::state::{StateError, Store};
use base64::Engine;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// The largest file a collect carries back in one message.
pub const MAX_COLLECT: u64 = 8 << 20;
const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

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
        let scratch = state.join("scratch");
        let _ = std::fs::remove_dir_all(&scratch);
        Ok(Node {
            store,
            runtime,
            scratch,
        })
    }

    /// Answers one command (blocking). Fenced by `generation`; mutating commands are answered
    /// from the applied record when redelivered, and recorded before the answer leaves.
    pub fn execute(&self, op: &str, generation: u64, command: &Command) -> Value {
        if let Err(e) = self.store.check_generation(generation) {
            return error(e);
        }
        if command.mutates() {
            match self.store.applied(op) {
                Ok(Some(recorded)) => return recorded,
                Ok(None) => {}
                Err(e) => return error(e),
            }
        }
        let result = match command {
            Command::Stage {
                digest,
                program_b64,
            } => self.stage(digest, program_b64),
            Command::Start(start) => self.start(op, start),
            Command::Stop { run_id } => match self.runtime.stop(run_id) {
                Ok(()) => ok(json!({ "stopping": run_id })),
                Err(e) => error(e),
            },
            Command::Status { run_id } => match self.runtime.status(run_id) {
                Ok(s) => ok(json!({ "state": s.state, "detail": s.detail })),
                Err(e) => error(e),
            },
            Command::Collect { run_id, path } => self.collect(run_id, path),
            Command::Facts => error("facts are answered by the session"),
        };
        if command.mutates()
            && let Err(e) = self.store.record_applied(op, &result)
        {
            return error(e);
        }
        result
    }

    fn scratch_file(&self, name: &str) -> Result<PathBuf, String> {
        std::fs::create_dir_all(&self.scratch)
            .map_err(|e| format!("cannot create {}: {e}", self.scratch.display()))?;
        Ok(self.scratch.join(name))
    }

    fn stage(&self, digest: &str, program_b64: &str) -> Value {
        let Ok(bytes) = B64.decode(program_b64) else {
            return error(format!("stage {digest}: the program is not base64"));
        };
        let file = match self.scratch_file(&format!("stage-{}", std::process::id())) {
            Ok(f) => f,
            Err(e) => return error(e),
        };
        if let Err(e) = std::fs::write(&file, &bytes) {
            return error(format!("stage {digest}: cannot write the program: {e}"));
        }
        let staged = self.runtime.stage(&file);
        let _ = std::fs::remove_file(&file);
        match staged {
            Ok(got) if got == digest => ok(json!({ "staged": got })),
            Ok(got) => error(format!(
                "stage {digest}: the bytes sent hash to {got}; resend the program"
            )),
            Err(e) => error(e),
        }
    }

    fn start(&self, op: &str, start: &StartRun) -> Value {
        let run_id = &start.run_id;
        // A run id belongs to the first operation that used it; another one is a duplicate.
        let claim = format!("run-claim:{run_id}");
        match self.store.applied(&claim) {
            Ok(Some(c)) if c["op"] != op => {
                return error(format!(
                    "run {run_id}: the run id is already used on this node; start it under a new run id"
                ));
            }
            Ok(Some(_)) => {}
            Ok(None) => {
                if let Err(e) = self.store.record_applied(&claim, &json!({ "op": op })) {
                    return error(e);
                }
            }
            Err(e) => return error(e),
        }
        let inputs = match self.write_inputs(start) {
            Ok(i) => i,
            Err(e) => return self.fail_run(run_id, &start.program, e),
        };
        if let Err(e) = self.store.track_run(run_id, &start.program) {
            return error(e);
        }
        let spec = RunSpec {
            run_id: run_id.clone(),
            program: start.program.clone(),
            argv: start.options.argv.iter().map(Into::into).collect(),
            timeout: start.options.timeout_ms.map(Duration::from_millis),
            grace: None,
            output_limit: start.options.output_limit,
            env: start.options.env.clone(),
            inputs,
        };
        let started = self.runtime.start(&spec);
        if let Some(dir) = spec.inputs.first().and_then(|(_, p)| p.parent()) {
            let _ = std::fs::remove_dir_all(dir);
        }
        match started {
            Ok(Started::New) => ok(json!({ "started": run_id })),
            Ok(Started::Already) => ok(json!({ "started": run_id, "already": true })),
            Err(e) => self.fail_run(run_id, &start.program, e.to_string()),
        }
    }

    /// A start that could not launch: the run is recorded `failed` with the reason, once.
    fn fail_run(&self, run_id: &str, program: &str, reason: String) -> Value {
        let recorded = self.store.track_run(run_id, program).and_then(|_| {
            self.store
                .transition(run_id, RunState::Failed, json!({ "error": reason }))
        });
        match recorded {
            Ok(_) => error(reason),
            Err(e) => error(e),
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

    fn collect(&self, run_id: &str, path: &str) -> Value {
        let out = match self.scratch_file(&format!("collect-{run_id}")) {
            Ok(f) => f,
            Err(e) => return error(e),
        };
        let result = match self.runtime.collect(run_id, path, &out) {
            Err(e) => error(e),
            Ok(digest) => {
                let size = std::fs::metadata(&out).map(|m| m.len()).unwrap_or(0);
                if size > MAX_COLLECT {
                    error(format!(
                        "run {run_id}: {path} is {size} bytes, over the {MAX_COLLECT} byte collect limit"
                    ))
                } else {
                    match std::fs::read(&out) {
                        Ok(bytes) => {
                            ok(json!({ "digest": digest, "content_b64": B64.encode(bytes) }))
                        }
                        Err(e) => error(format!(
                            "run {run_id}: cannot read the collected {path}: {e}"
                        )),
                    }
                }
            }
        };
        let _ = std::fs::remove_file(&out);
        result
    }
}
