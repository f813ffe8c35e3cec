//! Where things live under the store root: `store/sha256/<hex>`, `runs/<run>/`, `finished/`
//! and `tmp/`.
use crate::{Digest, RunId};
use std::path::{Path, PathBuf};

/// The default store root, shared with the agent.
pub const DEFAULT_ROOT: &str = "/var/lib/octomy-runs";

/// A run's record of how it ended; its presence makes the run final.
pub const RESULT_FILE: &str = "result.json";
/// Who supervises a run right now (pid, start time, boot), so a reader can tell `lost`.
pub const OWNER_FILE: &str = "supervisor.json";
pub const STDOUT_FILE: &str = "stdout";
pub const STDERR_FILE: &str = "stderr";
/// Names an `--input` may not take, since the run's record lives beside the program's files.
pub const RESERVED_NAMES: &[&str] = &[RESULT_FILE, OWNER_FILE, STDOUT_FILE, STDERR_FILE];

#[derive(Clone, Debug)]
pub struct Store {
    root: PathBuf,
}

impl Store {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Staged programs, one file per digest.
    pub fn programs_dir(&self) -> PathBuf {
        self.root.join("store").join("sha256")
    }

    pub fn program_path(&self, digest: &Digest) -> PathBuf {
        self.programs_dir().join(digest.hex())
    }

    pub fn runs_dir(&self) -> PathBuf {
        self.root.join("runs")
    }

    pub fn run_dir(&self, id: &RunId) -> PathBuf {
        self.runs_dir().join(id.as_str())
    }

    /// One empty marker per finished run, named so that sorting the names orders the runs by
    /// when they finished; retention reads this listing instead of every run's record.
    pub fn finished_dir(&self) -> PathBuf {
        self.root.join("finished")
    }

    /// Scratch space on the same filesystem, so a run appears and disappears by one rename.
    pub fn tmp_dir(&self) -> PathBuf {
        self.root.join("tmp")
    }
}
