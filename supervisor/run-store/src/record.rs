//! The JSON records a run keeps: `result.json` (how it ended, schema 1) and `supervisor.json`
//! (who supervises it now). `docs/supervisor.md` documents every field.
use fleet_vocab::Bytes;
use serde::{Deserialize, Serialize};

/// The version of both records; a reader refuses any other.
pub const SCHEMA: u32 = 1;

/// How a run ended, written once, atomically and durably, as `runs/<run>/result.json`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct RunResult {
    pub schema: u32,
    pub run: String,
    /// `sha256:<hex>` of the program as verified before the start.
    pub program: String,
    /// Exactly what execve received, argv[0] (the staged program's path) included.
    pub argv: Vec<Bytes>,
    /// `finished` or `failed`.
    pub state: FinalState,
    pub started: String,
    pub ended: String,
    pub duration_s: f64,
    /// The program's pid, once it was exec'd.
    pub pid: Option<u32>,
    /// The program's exit code when it exited by itself.
    pub exit_code: Option<i32>,
    /// The signal that ended the program, when one did.
    pub signal: Option<i32>,
    /// The timeout fired: the tree got SIGTERM (and SIGKILL after the grace period if needed).
    pub timed_out: bool,
    /// `stop` ended the run the same way.
    pub stopped: bool,
    pub timeout_s: Option<f64>,
    pub grace_s: f64,
    /// From SIGTERM to the tree being gone or SIGKILL, when the tree was terminated.
    pub grace_used_s: Option<f64>,
    /// SIGKILL was needed after the grace period.
    pub killed: bool,
    /// How the tree was held together: `cgroup` or `process-group`.
    pub containment: Option<String>,
    pub output_limit: u64,
    pub stdout: Option<StreamRecord>,
    pub stderr: Option<StreamRecord>,
    /// Why a `failed` run never started.
    pub failure: Option<Failure>,
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum FinalState {
    Finished,
    Failed,
}

/// One output stream: everything written is counted and hashed; the file keeps the first
/// `output_limit` bytes.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct StreamRecord {
    /// Bytes the program wrote.
    pub bytes: u64,
    /// Bytes kept in the stream's file.
    pub kept: u64,
    /// Some bytes were dropped past the limit (or because the disk refused them).
    pub truncated: bool,
    /// `sha256:<hex>` of all `bytes` written, kept or not.
    pub sha256: String,
    /// The last bytes written (up to 1 KiB), which the file may not hold once truncated.
    pub last: Bytes,
    /// Why writing the file stopped early, if the disk refused.
    pub write_error: Option<String>,
}

/// The step that refused a start, and why.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Failure {
    pub step: Step,
    pub reason: String,
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Step {
    /// The program was never staged.
    Stage,
    /// The staged bytes no longer match their digest.
    Verify,
    /// An `--input` could not be copied into the run.
    Input,
    /// The kernel refused to execute the program.
    Exec,
}

/// The detached supervisor of a running run, as `runs/<run>/supervisor.json`, written once,
/// just after the program was exec'd (not durably: liveness comes from the run's lock, see
/// [`crate::lock`]; this says whom `stop` signals and which pid the program has).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Owner {
    pub schema: u32,
    pub pid: u32,
    /// Field 22 of `/proc/<pid>/stat`: tells a reused pid apart.
    pub start_time: u64,
    /// `/proc/sys/kernel/random/boot_id`: tells a reboot apart.
    pub boot_id: String,
    pub program_pid: u32,
}

impl Step {
    pub fn as_str(self) -> &'static str {
        match self {
            Step::Stage => "stage",
            Step::Verify => "verify",
            Step::Input => "input",
            Step::Exec => "exec",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Bytes;

    #[test]
    fn bytes_round_trip_as_text_or_hex() {
        let text = Bytes(b"two words\n".to_vec());
        assert_eq!(serde_json::to_string(&text).unwrap(), r#""two words\n""#);
        let raw = Bytes(vec![0xff, 0x00, b'a']);
        let json = serde_json::to_string(&raw).unwrap();
        assert_eq!(json, r#"{"hex":"ff0061"}"#);
        assert_eq!(serde_json::from_str::<Bytes>(&json).unwrap(), raw);
        assert_eq!(serde_json::from_str::<Bytes>(r#""x""#).unwrap().0, b"x");
    }
}
