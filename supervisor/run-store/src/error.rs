//! The store's errors, each one lowercase line naming what was wrong and what to do.
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("bad run id {0:?}: use 1 to 64 characters of A-Z a-z 0-9 . _ - (not . or ..)")]
    BadRunId(String),
    #[error("bad program digest {0:?}: use sha256: followed by 64 lowercase hex digits")]
    BadDigest(String),
    #[error("run {id:?} does not exist in {}: check the run id and --root", runs.display())]
    UnknownRun { id: String, runs: PathBuf },
    #[error("cannot read {}: {reason}", path.display())]
    Read { path: PathBuf, reason: String },
    #[error("{} is corrupt: {reason}; remove the run folder by hand", path.display())]
    Corrupt { path: PathBuf, reason: String },
}

/// An I/O error as a lowercase reason without the "(os error N)" suffix, for one-line messages.
pub fn describe_io(e: &std::io::Error) -> String {
    let text = e.to_string();
    let text = match text.find(" (os error") {
        Some(at) => &text[..at],
        None => &text,
    };
    let mut chars = text.chars();
    match chars.next() {
        Some(first) => first.to_lowercase().chain(chars).collect(),
        None => String::new(),
    }
}

impl From<fleet_vocab::RunIdError> for Error {
    fn from(e: fleet_vocab::RunIdError) -> Error {
        Error::BadRunId(e.0)
    }
}

/// The supervisor names a bad digest as the program's, with its own advice.
impl From<fleet_vocab::DigestError> for Error {
    fn from(e: fleet_vocab::DigestError) -> Error {
        Error::BadDigest(e.0)
    }
}

impl Error {
    /// The exit status class this error is reported with.
    pub fn refusal(&self) -> crate::Refusal {
        match self {
            Error::UnknownRun { .. } => crate::Refusal::UnknownRun,
            _ => crate::Refusal::Other,
        }
    }
}
