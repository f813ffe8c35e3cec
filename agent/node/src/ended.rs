//! What the agent does once the fleet's operator ends its node. Revoked: it stops its runs,
//! notes the end in its state (a restart then stops at once, without dialing) and stops, keeping
//! the rest for whoever looks at the machine. Retired: it stops its runs, removes its state,
//! disables its unit and stops. Either way it exits with [`ENDED_EXIT_STATUS`], which the unit
//! names in `RestartPreventExitStatus`, so systemd does not start it again.
use crate::node::Node;
use fleet_content::files;
use fleet_proto::protocol::NodeEnd;
use fleet_proto::unit::{ENDED_EXIT_STATUS, UNIT_NAME};
use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The file in the state folder that notes a revoked node.
const ENDED_FILE: &str = "ended";

/// The node was ended: the agent's last line, and its exit status.
#[derive(Debug, thiserror::Error)]
pub enum EndedError {
    #[error(
        "the fleet's operator revoked this machine's key: the agent stopped its runs and will not dial again; its state stays in {} for inspection (remove the folder and give the machine a new join file to join again)",
        .0.display()
    )]
    Revoked(PathBuf),
    #[error(
        "the fleet's operator retired this machine: the agent stopped its runs, removed its state {} and {unit}",
        .state.display()
    )]
    Retired { state: PathBuf, unit: String },
    #[error(
        "the fleet's operator ended this machine, but the agent cannot finish: {0}; stop the agent by hand"
    )]
    Unfinished(io::Error),
}

impl EndedError {
    /// The exit status that tells systemd not to start the agent again.
    pub fn status(&self) -> i32 {
        ENDED_EXIT_STATUS
    }
}

/// The end an earlier run of the agent noted in `state`, if any.
pub fn noted(state: &Path) -> Option<EndedError> {
    let text = std::fs::read_to_string(state.join(ENDED_FILE)).ok()?;
    (text.trim() == NodeEnd::Revoked.as_str()).then(|| EndedError::Revoked(state.to_path_buf()))
}

/// Stops the node's runs and does what `end` asks of the machine; answers the agent's last line.
pub fn carry_out(end: NodeEnd, state: &Path, node: &Node) -> EndedError {
    node.stop_runs();
    let done = match end {
        NodeEnd::Revoked => files::write_private(&state.join(ENDED_FILE), end.as_str().as_bytes())
            .map(|()| EndedError::Revoked(state.to_path_buf())),
        NodeEnd::Retired => remove_contents(state).map(|()| EndedError::Retired {
            state: state.to_path_buf(),
            unit: disable_unit(),
        }),
    };
    done.unwrap_or_else(EndedError::Unfinished)
}

/// Removes what the state folder holds; the folder itself is the unit's `StateDirectory`.
fn remove_contents(dir: &Path) -> io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        match path.is_dir() && !path.is_symlink() {
            true => std::fs::remove_dir_all(&path)?,
            false => std::fs::remove_file(&path)?,
        }
    }
    Ok(())
}

/// Disables the agent's unit through systemd (which removes its links itself, outside the
/// unit's read-only view of /etc); says what became of it.
fn disable_unit() -> String {
    match Command::new("systemctl")
        .args(["disable", UNIT_NAME])
        .output()
    {
        Ok(out) if out.status.success() => format!("disabled {UNIT_NAME}"),
        Ok(out) => format!(
            "could not disable {UNIT_NAME} (systemctl: {})",
            String::from_utf8_lossy(&out.stderr)
                .trim()
                .replace('\n', " ")
        ),
        Err(e) => format!("could not disable {UNIT_NAME} (no systemctl: {e})"),
    }
}
