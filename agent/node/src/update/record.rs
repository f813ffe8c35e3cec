//! What the machine remembers of its releases, in `STATE/release.json`, written whole or not at
//! all: the floor it may never go below, the releases that failed here, and the last update.
use fleet_proto::release::{ReleaseTrust, UpdateOutcome};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReleaseRecord {
    /// The lowest sequence this machine may ever take again: the highest `min_sequence` of the
    /// releases it kept.
    #[serde(default)]
    pub floor: u64,
    /// Releases that failed their trial here, and why: never tried again.
    #[serde(default)]
    pub never: BTreeMap<u64, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last: Option<UpdateOutcome>,
    /// The trial under way, when there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trial: Option<TrialTerms>,
    /// The last revert was for want of a session: it is blamed on the release (added to `never`)
    /// only once the restored agent holds one.
    #[serde(default)]
    pub unconfirmed: bool,
    /// The roots and revoked release keys the last release that changed them named (signed
    /// under what this machine trusted then); None: the join file's roots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trust: Option<ReleaseTrust>,
}

/// A trial's terms, set before the swap.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrialTerms {
    /// When the swap began, by this machine's clock (Unix ms).
    pub began_at_ms: u64,
    /// The floor the release sets once it is kept.
    pub min_sequence: u64,
}

fn path(state: &Path) -> PathBuf {
    state.join("release.json")
}

impl ReleaseRecord {
    /// The record in `state`; none yet is the empty record.
    pub fn load(state: &Path) -> io::Result<ReleaseRecord> {
        match std::fs::read(path(state)) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| {
                io::Error::other(format!(
                    "{} is not a release record: {e}",
                    path(state).display()
                ))
            }),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(ReleaseRecord::default()),
            Err(e) => Err(e),
        }
    }

    pub fn save(&self, state: &Path) -> io::Result<()> {
        // Cannot fail: plain data with string keys.
        let bytes = serde_json::to_vec_pretty(self).expect("a release record serializes");
        fleet_content::files::write_private(&path(state), &bytes)
    }

    /// Records that `to` failed its trial and `from` is restored; blamed at once unless `unconfirmed`.
    pub fn reverted(&mut self, from: u64, to: u64, reason: String, unconfirmed: bool) {
        if !unconfirmed {
            self.never.insert(to, reason.clone());
        }
        self.unconfirmed = unconfirmed;
        self.trial = None;
        self.last = Some(UpdateOutcome::Reverted { from, to, reason });
    }
}
