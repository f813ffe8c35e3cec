//! The bundles a fresh machine downloads: `hub-linux-<arch>.tar.gz`, named in its user data by
//! SHA-256.
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// The SHA-256 of a file, hex.
pub fn file_sha256(path: &Path) -> std::io::Result<String> {
    let mut file = std::fs::File::open(path)?;
    let mut hasher = Sha256::new();
    std::io::copy(&mut file, &mut hasher)?;
    Ok(hex::encode(hasher.finalize()))
}

/// The bundle file for one architecture.
pub fn bundle_path(bundles: &Path, arch: &str) -> PathBuf {
    bundles.join(format!("hub-linux-{arch}.tar.gz"))
}
