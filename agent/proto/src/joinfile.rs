//! The join file cloud-init hands a new machine, and the removal of every copy of it once joined.
use crate::pin;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

/// Where cloud-init's user data lands by default: a memory filesystem.
pub const DEFAULT_PATH: &str = "/run/octomy/fleet.json";

/// A secret string whose Debug form never shows it, so it cannot reach a log by accident.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Secret(pub String);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

/// The join file: where the coordinator is, its pinned key and the one-time token.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JoinFile {
    /// The coordinator's `host:port`.
    pub address: String,
    /// The fleet's other coordinators (`host:port`), tried in turn when `address` does not
    /// answer; they share the pinned key.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub alternates: Vec<String>,
    /// The coordinator's public key, `ed25519:<base64>`.
    pub coordinator_key: String,
    pub token: Secret,
    /// When the token stops being accepted, by the coordinator's clock (Unix milliseconds). The
    /// coordinator judges expiry; the agent only compares it with its own clock to warn of skew.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at_ms: Option<u64>,
    /// How long the token was minted to last. The agent stops retrying this long after it first
    /// read the file, measured on its own monotonic clock, so no wall clocks need to agree.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bundle_sha256: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// The fleet's release root keys: the agent takes only a release certified by one of them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub release_roots: Vec<crate::pin::PinnedKey>,
}

#[derive(Debug, thiserror::Error)]
pub enum JoinFileError {
    #[error("the join file {} does not exist: pass --join-file PATH, or mint one with `fleet-coordinator token`", .0.display())]
    Missing(PathBuf),
    #[error("cannot read the join file {}: {cause}", path.display())]
    Unreadable { path: PathBuf, cause: io::Error },
    #[error("the join file {} is not JSON ({reason}): mint a new one with `fleet-coordinator token`", path.display())]
    NotJson { path: PathBuf, reason: String },
    #[error("the join file {} has no `{field}` field: mint a new one with `fleet-coordinator token`", path.display())]
    MissingField { path: PathBuf, field: &'static str },
    #[error("the join file {} holds a malformed token (expected {TOKEN_PREFIX} and {TOKEN_BODY_LEN} base64url characters): it was damaged on the way; mint a new one with `fleet-coordinator token`", path.display())]
    BadToken { path: PathBuf },
    #[error("the join file {} is invalid ({reason}): mint a new one with `fleet-coordinator token`", path.display())]
    Invalid { path: PathBuf, reason: String },
}

const REQUIRED: [&str; 3] = ["address", "coordinator_key", "token"];

/// Every token starts with this; the rest is 32 random bytes in unpadded base64url.
pub const TOKEN_PREFIX: &str = "fleet1_";
const TOKEN_BODY_LEN: usize = 43;

/// Whether `token` has the shape the coordinator mints, so a damaged one is refused before any
/// connection instead of being retried until it expires.
pub fn token_is_well_formed(token: &str) -> bool {
    token.strip_prefix(TOKEN_PREFIX).is_some_and(|body| {
        body.len() == TOKEN_BODY_LEN
            && body
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    })
}

impl JoinFile {
    /// Every coordinator the file names, `address` first, each once.
    pub fn addresses(&self) -> Vec<String> {
        let mut all = vec![self.address.clone()];
        for other in &self.alternates {
            if !all.contains(other) {
                all.push(other.clone());
            }
        }
        all
    }

    /// Reads and checks a join file, naming the first thing wrong with it.
    pub fn read(path: &Path) -> Result<JoinFile, JoinFileError> {
        let bytes = std::fs::read(path).map_err(|cause| match cause.kind() {
            io::ErrorKind::NotFound => JoinFileError::Missing(path.to_path_buf()),
            _ => JoinFileError::Unreadable {
                path: path.to_path_buf(),
                cause,
            },
        })?;
        let value: serde_json::Value =
            serde_json::from_slice(&bytes).map_err(|e| JoinFileError::NotJson {
                path: path.to_path_buf(),
                reason: e.to_string(),
            })?;
        let invalid = |reason: String| JoinFileError::Invalid {
            path: path.to_path_buf(),
            reason,
        };
        let object = value
            .as_object()
            .ok_or_else(|| invalid("expected a JSON object".into()))?;
        if let Some(field) = REQUIRED.into_iter().find(|f| !object.contains_key(*f)) {
            return Err(JoinFileError::MissingField {
                path: path.to_path_buf(),
                field,
            });
        }
        let file: JoinFile = serde_json::from_value(value).map_err(|e| invalid(e.to_string()))?;
        if !token_is_well_formed(&file.token.0) {
            return Err(JoinFileError::BadToken {
                path: path.to_path_buf(),
            });
        }
        if pin::parse_key_text(&file.coordinator_key).is_none() {
            return Err(invalid(
                "coordinator_key is not ed25519:<base64 of 32 bytes>".into(),
            ));
        }
        Ok(file)
    }

    pub fn pinned_key(&self) -> Vec<u8> {
        self.pin().as_bytes().to_vec()
    }

    /// The coordinator's key to pin, checked when [`JoinFile::read`] read the file.
    pub fn pin(&self) -> pin::PinnedKey {
        // Cannot fail: `JoinFile::read` refused a file whose key does not parse.
        pin::PinnedKey::parse(&self.coordinator_key).expect("checked when read")
    }
}

/// Removes cloud-init's copies of the user data that carried the join file, blanks the token
/// inside what cloud-init must keep (its datasource cache `obj.pkl`, which it restores and
/// writes the copies from at every boot), then removes the join file, last, so a crash midway
/// is finished at the next start; returns what it removed or rewrote.
pub fn remove_secrets(join_file: &Path, cloud_root: &Path) -> io::Result<Vec<PathBuf>> {
    let mut folders = vec![cloud_root.join("instance")];
    if let Ok(entries) = std::fs::read_dir(cloud_root.join("instances")) {
        folders.extend(entries.filter_map(|e| e.ok()).map(|e| e.path()));
    }
    let mut done = Vec::new();
    if let Some(token) = token_in(join_file) {
        for folder in &folders {
            done.extend(blank_token(folder, &token)?);
        }
    }
    let mut candidates = Vec::new();
    for folder in folders {
        for name in [
            "user-data.txt",
            "user-data.txt.i",
            "cloud-config.txt",
            "scripts",
        ] {
            candidates.push(folder.join(name));
        }
    }
    candidates.push(join_file.to_path_buf());
    for path in candidates {
        let result = match std::fs::symlink_metadata(&path) {
            Ok(meta) if meta.is_dir() => std::fs::remove_dir_all(&path),
            Ok(_) => std::fs::remove_file(&path),
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => Err(e),
        };
        match result {
            Ok(()) => done.push(path),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io::Error::new(e.kind(), format!("{}: {e}", path.display()))),
        }
    }
    Ok(done)
}

/// The token of a join file still there, read leniently (only its `token` field matters here).
fn token_in(join_file: &Path) -> Option<String> {
    let bytes = std::fs::read(join_file).ok()?;
    let value: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    let token = value.get("token")?.as_str()?;
    token_is_well_formed(token).then(|| token.to_string())
}

/// The largest file of an instance folder searched for the token (obj.pkl is a few KiB).
const LARGEST_SEARCHED: u64 = 64 << 20;

/// Overwrites every copy of `token` in the regular files directly in `folder` with `x`s of the
/// same length, in a file that replaces the old one by rename with its mode: a pickle's lengths
/// stay right, so cloud-init still loads its cache, and what it writes from it is harmless.
fn blank_token(folder: &Path, token: &str) -> io::Result<Vec<PathBuf>> {
    use std::os::unix::fs::PermissionsExt;
    let Ok(entries) = std::fs::read_dir(folder) else {
        return Ok(Vec::new());
    };
    let mut rewritten = Vec::new();
    for entry in entries.filter_map(|e| e.ok()) {
        let path = entry.path();
        let meta = std::fs::symlink_metadata(&path)?;
        if !meta.is_file() || meta.len() > LARGEST_SEARCHED {
            continue;
        }
        let bytes = std::fs::read(&path)?;
        let needle = token.as_bytes();
        if !bytes.windows(needle.len()).any(|w| w == needle) {
            continue;
        }
        let mut blanked = Vec::with_capacity(bytes.len());
        let mut rest = &bytes[..];
        while let Some(at) = rest.windows(needle.len()).position(|w| w == needle) {
            blanked.extend_from_slice(&rest[..at]);
            blanked.extend(std::iter::repeat_n(b'x', needle.len()));
            rest = &rest[at + needle.len()..];
        }
        blanked.extend_from_slice(rest);
        let temp = folder.join(format!(".fleet-agent-blank-{}", std::process::id()));
        let written = (|| {
            let mut file = std::fs::File::create(&temp)?;
            std::io::Write::write_all(&mut file, &blanked)?;
            file.set_permissions(std::fs::Permissions::from_mode(meta.permissions().mode()))?;
            file.sync_all()?;
            std::fs::rename(&temp, &path)?;
            std::fs::File::open(folder)?.sync_all()
        })();
        if let Err(e) = written {
            let _ = std::fs::remove_file(&temp);
            return Err(io::Error::new(e.kind(), format!("{}: {e}", path.display())));
        }
        rewritten.push(path);
    }
    Ok(rewritten)
}

#[cfg(test)]
mod tests {
    use super::token_is_well_formed;

    #[test]
    fn a_token_is_blanked_in_place_and_the_file_keeps_its_length_and_mode() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let token = format!("fleet1_{}", "B".repeat(43));
        let cache = dir.path().join("obj.pkl");
        let before = [
            b"\x80\x04X\x32\x00\x00\x00".as_slice(),
            token.as_bytes(),
            b"..",
            token.as_bytes(),
        ]
        .concat();
        std::fs::write(&cache, &before).unwrap();
        std::fs::set_permissions(&cache, std::fs::Permissions::from_mode(0o400)).unwrap();
        std::fs::write(dir.path().join("other"), b"nothing here").unwrap();
        let rewritten = super::blank_token(dir.path(), &token).unwrap();
        assert_eq!(rewritten, std::slice::from_ref(&cache));
        let after = std::fs::read(&cache).unwrap();
        assert_eq!(after.len(), before.len());
        assert!(!after.windows(token.len()).any(|w| w == token.as_bytes()));
        assert_eq!(&after[..7], &before[..7], "what is around the token stays");
        let mode = std::fs::metadata(&cache).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o400);
        assert_eq!(
            std::fs::read(dir.path().join("other")).unwrap(),
            b"nothing here"
        );
    }

    #[test]
    fn token_shape() {
        let good = format!("fleet1_{}", "A".repeat(43));
        assert!(token_is_well_formed(&good));
        assert!(!token_is_well_formed(&good[..good.len() - 1]));
        assert!(!token_is_well_formed(&format!("fleet2_{}", "A".repeat(43))));
        assert!(!token_is_well_formed(&format!(
            "fleet1_{}+",
            "A".repeat(42)
        )));
    }
}
