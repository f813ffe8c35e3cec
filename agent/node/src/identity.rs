//! The node's identity in its state folder: the private key (0600, never leaves the machine) and
//! the membership record written once the join succeeded. Corrupt files stop the agent; it never
//! silently makes a new identity.
use fleet_content::files;
use rcgen::KeyPair;
use serde::{Deserialize, Serialize};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

pub const KEY_FILE: &str = "node.key";
pub const MEMBERSHIP_FILE: &str = "membership.json";

#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("the state directory {} is not writable ({cause}): pass --state DIR on a writable disk", path.display())]
    NotWritable { path: PathBuf, cause: io::Error },
    #[error("the {what} {} is corrupt ({reason}): restore it, or remove {} to join again as a new node", path.display(), path.parent().unwrap_or(Path::new("/")).display())]
    Corrupt {
        what: &'static str,
        path: PathBuf,
        reason: String,
    },
    #[error("cannot read {}: {cause}", path.display())]
    Read { path: PathBuf, cause: io::Error },
    #[error("cannot write {}: {cause}", path.display())]
    Write { path: PathBuf, cause: io::Error },
    #[error("cannot make a key pair: {0}")]
    Keygen(String),
}

/// The node's key pair.
#[derive(Debug)]
pub struct Identity {
    pub key: KeyPair,
}

impl Identity {
    pub fn public_key(&self) -> &[u8] {
        self.key.public_key_raw()
    }
}

/// What the node keeps after joining: who it is and whom it talks to. Holds no secret.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Membership {
    pub node_id: fleet_proto::NodeId,
    /// The coordinator's `host:port`.
    pub address: String,
    /// The fleet's other coordinators, as the join file and the newest session named them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub alternates: Vec<String>,
    /// The coordinator's pinned key, `ed25519:<base64>`; a corrupt one fails the record's read.
    pub coordinator_key: fleet_proto::pin::PinnedKey,
    #[serde(default)]
    pub name: Option<String>,
    pub joined_at_ms: u64,
    /// The fleet's release root keys, from the join file: a release is taken only when one of
    /// them certified its key.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub release_roots: Vec<fleet_proto::pin::PinnedKey>,
}

impl Membership {
    /// Every coordinator known, the one joined through first.
    pub fn addresses(&self) -> Vec<String> {
        let mut all = vec![self.address.clone()];
        all.extend(
            self.alternates
                .iter()
                .filter(|a| **a != self.address)
                .cloned(),
        );
        all
    }
}

/// Creates the state folder and proves it can be written, before anything else happens.
pub fn prepare_state_dir(dir: &Path) -> Result<(), IdentityError> {
    let not_writable = |cause| IdentityError::NotWritable {
        path: dir.to_path_buf(),
        cause,
    };
    files::create_private_dir(dir).map_err(not_writable)?;
    let probe = dir.join(".write-probe");
    files::write_private(&probe, b"").map_err(not_writable)?;
    fs::remove_file(&probe).map_err(not_writable)
}

/// Loads the node key, or makes one on the very first start (no key and no membership yet).
pub fn load_or_create(dir: &Path) -> Result<Identity, IdentityError> {
    let path = dir.join(KEY_FILE);
    match fs::read_to_string(&path) {
        Ok(pem) => {
            let key = KeyPair::from_pem(&pem).map_err(|e| IdentityError::Corrupt {
                what: "node key",
                path: path.clone(),
                reason: e.to_string(),
            })?;
            if key.public_key_raw().len() != 32 {
                return Err(IdentityError::Corrupt {
                    what: "node key",
                    path,
                    reason: "not an Ed25519 key".into(),
                });
            }
            Ok(Identity { key })
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            // A membership without its key means the key was lost: that is corruption, not a new node.
            let membership = dir.join(MEMBERSHIP_FILE);
            if membership.exists() {
                return Err(IdentityError::Corrupt {
                    what: "node key",
                    path,
                    reason: format!("missing while {} exists", membership.display()),
                });
            }
            let key = KeyPair::generate_for(&rcgen::PKCS_ED25519)
                .map_err(|e| IdentityError::Keygen(e.to_string()))?;
            files::write_private(&path, key.serialize_pem().as_bytes())
                .map_err(|cause| IdentityError::Write { path, cause })?;
            Ok(Identity { key })
        }
        Err(e) if e.kind() == io::ErrorKind::InvalidData => Err(IdentityError::Corrupt {
            what: "node key",
            path,
            reason: "not text".into(),
        }),
        Err(cause) => Err(IdentityError::Read { path, cause }),
    }
}

/// The membership record, or None before the first successful join.
pub fn load_membership(dir: &Path) -> Result<Option<Membership>, IdentityError> {
    let path = dir.join(MEMBERSHIP_FILE);
    let bytes = match fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(cause) => return Err(IdentityError::Read { path, cause }),
    };
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| IdentityError::Corrupt {
            what: "membership record",
            path,
            reason: e.to_string(),
        })
}

pub fn save_membership(dir: &Path, membership: &Membership) -> Result<(), IdentityError> {
    let path = dir.join(MEMBERSHIP_FILE);
    // Cannot fail: a membership is plain data with string keys, which always serializes.
    let json = serde_json::to_vec_pretty(membership).expect("membership serializes");
    files::write_private(&path, &json).map_err(|cause| IdentityError::Write { path, cause })
}
