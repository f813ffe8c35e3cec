//! The narrow interface between the agent and what runs programs: stage, start, stop, status,
//! collect, list; [`ProcessRuntime`] drives `fleet-run-supervisor`, a container runtime plugs in beside it.
//!
//! The interface is blocking on purpose: each call is a short child process (or, later, a short
//! HTTP call to a daemon). Async callers wrap calls in `tokio::task::spawn_blocking`, so the agent's
//! loop never stalls on a slow disk, and runtimes stay free of any async runtime.

mod changes;
pub mod docker;
mod error;
mod process;
mod routed;
mod watch;

pub use changes::Changes;
pub use docker::DockerRuntime;
pub use error::RuntimeError;
pub use fleet_proto::run::{
    Gpus, ImageRef, Outcome, RegistryAuth, Resources, RunReport, RunState, Workload,
};
pub use process::{DEFAULT_ROOT, ProcessRuntime, SUPERVISOR_NAME};
pub use routed::Routed;
pub use watch::{SyncReport, sync_run, sync_runs};

use fleet_proto::RunId;
use std::ffi::OsString;
use std::io::Seek;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Everything needed to start one run: a staged program or an image, both by digest.
#[derive(Debug, Clone, PartialEq)]
pub struct RunSpec {
    pub run_id: RunId,
    pub workload: Workload,
    /// Arguments after the program, as raw bytes (not necessarily UTF-8).
    pub argv: Vec<OsString>,
    pub timeout: Option<Duration>,
    /// Time between the polite stop signal and the kill, when the runtime supports one.
    pub grace: Option<Duration>,
    /// Bytes kept per output stream.
    pub output_limit: Option<u64>,
    /// Environment added to the runtime's clean default, as `(NAME, VALUE)`.
    pub env: Vec<(String, String)>,
    /// Input files copied into the run before it starts, as `(NAME, FILE)`.
    pub inputs: Vec<(String, PathBuf)>,
    /// Limits and devices; a runtime refuses what it cannot enforce.
    pub resources: Resources,
    /// The credential for pulling an image, held only for this start.
    pub registry_auth: Option<RegistryAuth>,
}

impl RunSpec {
    /// A spec with only the required fields; the rest take the runtime's defaults.
    pub fn new(run_id: RunId, workload: Workload) -> RunSpec {
        RunSpec {
            run_id,
            workload,
            argv: Vec::new(),
            timeout: None,
            grace: None,
            output_limit: None,
            env: Vec::new(),
            inputs: Vec::new(),
            resources: Resources::default(),
            registry_auth: None,
        }
    }
}

/// What a start did: a redelivered start of a run that exists is harmless, not an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Started {
    /// This call launched the run.
    New,
    /// The run id was already claimed; nothing was launched.
    Already,
}

/// One run as the runtime sees it now.
#[derive(Debug, Clone, PartialEq)]
pub struct RunStatus {
    pub run_id: RunId,
    pub state: RunState,
    /// The typed outcome once there is one, why it failed, and the runtime's own record (for the
    /// process runtime, the supervisor's status with `result.json`); sent on in the event.
    pub report: RunReport,
}

/// A file collected out of a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Collected {
    pub digest: fleet_proto::Digest,
    pub size: u64,
}

/// A file collected out of a run, open for reading from its start: the run's own file, or a
/// copy that is removed when this is dropped.
#[derive(Debug)]
pub struct CollectedFile {
    pub file: std::fs::File,
    pub size: u64,
    copy: Option<PathBuf>,
}

impl CollectedFile {
    /// The run's own file, read in place.
    pub fn in_place(file: std::fs::File, size: u64) -> CollectedFile {
        CollectedFile {
            file,
            size,
            copy: None,
        }
    }
}

impl Drop for CollectedFile {
    fn drop(&mut self) {
        if let Some(copy) = &self.copy {
            let _ = std::fs::remove_file(copy);
        }
    }
}

/// The operations the agent needs from a runtime. Every method blocks; see the module docs.
/// The digests a runtime holds, and how many of them are engine images.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Held {
    pub digests: Vec<fleet_proto::Digest>,
    pub images: u64,
}

pub trait Runtime: Send + Sync {
    /// Stages a program file by digest and returns the digest.
    fn stage(&self, file: &std::path::Path) -> Result<fleet_proto::Digest, RuntimeError>;
    /// Starts a run detached from the caller, so it outlives an agent restart.
    fn start(&self, spec: &RunSpec) -> Result<Started, RuntimeError>;
    /// Stops a run the way its timeout would (polite signal, then a kill after its grace) and
    /// returns once it has ended; stopping a run that already ended changes nothing.
    fn stop(&self, run_id: &RunId) -> Result<(), RuntimeError>;
    /// The run's current state.
    fn status(&self, run_id: &RunId) -> Result<RunStatus, RuntimeError>;
    /// Streams a file of the run's folder into `sink`, refusing one over `max_bytes` before any
    /// byte is written, and returns its digest and size.
    fn collect(
        &self,
        run_id: &RunId,
        path: &str,
        max_bytes: u64,
        sink: &mut dyn std::io::Write,
    ) -> Result<Collected, RuntimeError>;
    /// Opens a file of the run's folder to send on, refusing one over `max_bytes` before any
    /// byte is sent. By default a copy through [`Runtime::collect`] into a new file at `scratch`
    /// (removed when the [`CollectedFile`] is dropped); a runtime that can open the run's own
    /// file safely saves that pass over the bytes.
    fn open_collected(
        &self,
        run_id: &RunId,
        path: &str,
        max_bytes: u64,
        scratch: &Path,
    ) -> Result<CollectedFile, RuntimeError> {
        let failed = |e: std::io::Error| RuntimeError::Refused {
            run_id: run_id.clone(),
            reason: format!("cannot write {}: {e}", scratch.display()),
        };
        let mut file = (std::fs::File::options().read(true).write(true))
            .create_new(true)
            .open(scratch)
            .map_err(failed)?;
        let mut copy = CollectedFile {
            size: 0,
            file: file.try_clone().map_err(failed)?,
            copy: Some(scratch.to_path_buf()),
        };
        let collected = self.collect(run_id, path, max_bytes, &mut file)?;
        file.seek(std::io::SeekFrom::Start(0)).map_err(failed)?;
        copy.size = collected.size;
        Ok(copy)
    }
    /// Every run the runtime holds.
    fn list(&self) -> Result<Vec<RunStatus>, RuntimeError>;
    /// The content it holds by digest (staged programs, the engine's images); none by default.
    fn held(&self) -> Held {
        Held::default()
    }
    /// The container engine it drives, as last reached; None where it drives none.
    fn engine(&self) -> Option<fleet_proto::facts::EngineFacts> {
        None
    }
    /// Has the engine read `image`'s manifest from its registry; its digest, or why not.
    fn read_manifest(&self, image: &str) -> Result<fleet_proto::Digest, String> {
        Err(format!("{image}: this agent drives no container engine"))
    }
    /// Where the runtime notes runs that changed on their own, as soon as it learns of it;
    /// `None`: changes are seen only by asking (the agent's watch).
    fn changes(&self) -> Option<Changes> {
        None
    }
    /// Cleans up what the runtime keeps beyond the runs' records, given each run's recorded
    /// state on the node (`None`: no record); returns the runs whose leftovers it removed. The
    /// process runtime's store keeps its own retention, so by default nothing is done.
    fn tidy(
        &self,
        _record: &dyn Fn(&RunId) -> Option<RunState>,
    ) -> Result<Vec<RunId>, RuntimeError> {
        Ok(Vec::new())
    }
}
