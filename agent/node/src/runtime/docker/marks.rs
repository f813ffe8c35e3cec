//! The marker files saying why a run ended (stopped, timed out), which the engine cannot hold.
use super::{DockerRuntime, RuntimeError};
use fleet_proto::RunId;
use std::path::{Path, PathBuf};

/// Why a run ended, when the engine cannot say: written before the stop is asked for.
#[derive(Clone, Copy)]
pub(super) enum Mark {
    Stopped,
    TimedOut,
}

impl Mark {
    fn file(self) -> &'static str {
        match self {
            Mark::Stopped => "stopped",
            Mark::TimedOut => "timed-out",
        }
    }
}

impl DockerRuntime {
    pub(super) fn mark_path(&self, run_id: &RunId, mark: Mark) -> PathBuf {
        mark_path(&self.marks, run_id, mark)
    }

    pub(super) fn marked(&self, run_id: &RunId, mark: Mark) -> bool {
        self.mark_path(run_id, mark).exists()
    }

    pub(super) fn set_mark(&self, run_id: &RunId, mark: Mark) -> Result<(), RuntimeError> {
        set_mark(&self.marks, run_id, mark)
    }
}

fn mark_path(marks: &Path, run_id: &RunId, mark: Mark) -> PathBuf {
    marks.join(format!("{run_id}.{}", mark.file()))
}

pub(super) fn set_mark(marks: &Path, run_id: &RunId, mark: Mark) -> Result<(), RuntimeError> {
    let path = mark_path(marks, run_id, mark);
    std::fs::create_dir_all(marks)
        .and_then(|()| std::fs::write(&path, b""))
        .map_err(|e| RuntimeError::Refused {
            run_id: run_id.clone(),
            reason: format!(
                "cannot record why the run ends in {}: {e}; check the agent's state folder",
                path.display()
            ),
        })
}
