//! A node's acceptance checks (`fleet-coordinator check`): what it asks of the machine before
//! work lands there, and one row per check with its verdict and one line saying why.
use serde::{Deserialize, Serialize};

/// What the coordinator asks a node to check on itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckRequest {
    /// An image (`HOST/REPO:TAG` or `HOST/REPO@sha256:HEX`) whose manifest the node's engine
    /// must read from its registry; None skips the registry check.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub registry: Option<String>,
    /// The least free disk under the run store that passes.
    pub min_disk_bytes: u64,
}

/// One of the checks, in the order they are shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CheckName {
    /// The node answers in its session at all (judged by the coordinator).
    Session,
    /// Its engine reaches the registry and reads the image's manifest.
    Registry,
    /// Content written to its store reads back whole.
    Store,
    /// Its clock agrees with the coordinator's (judged by the coordinator).
    Clock,
    /// Free disk under the run store.
    Disk,
    /// The container engine answers.
    Engine,
}

impl CheckName {
    pub fn as_str(self) -> &'static str {
        match self {
            CheckName::Session => "session",
            CheckName::Registry => "registry",
            CheckName::Store => "store",
            CheckName::Clock => "clock",
            CheckName::Disk => "disk",
            CheckName::Engine => "engine",
        }
    }
}

/// How one check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Pass,
    Fail,
    /// Not asked for (no `--registry`).
    Skipped,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Pass => "pass",
            Verdict::Fail => "fail",
            Verdict::Skipped => "skipped",
        }
    }
}

/// One check's row: its verdict and one line for people.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckRow {
    pub check: CheckName,
    pub verdict: Verdict,
    pub detail: String,
}

impl CheckRow {
    pub fn new(check: CheckName, verdict: Verdict, detail: impl Into<String>) -> CheckRow {
        CheckRow {
            check,
            verdict,
            detail: detail.into(),
        }
    }

    /// A pass when `outcome` is Ok, a failure naming why otherwise.
    pub fn of(check: CheckName, outcome: Result<String, String>) -> CheckRow {
        match outcome {
            Ok(detail) => CheckRow::new(check, Verdict::Pass, detail),
            Err(why) => CheckRow::new(check, Verdict::Fail, why),
        }
    }
}
