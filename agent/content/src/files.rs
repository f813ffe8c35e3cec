//! Private small files (a key, an identity), written crash-safe by the run store's one atomic
//! replacement (temp file, fsync, rename, fsync the folder), readable by their owner only.
use std::fs::{self, Permissions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::Path;

/// Writes `bytes` to `path` (mode 0600) so that a reader sees the old content or the new, never a
/// torn file; the new content survives a power cut.
pub fn write_private(path: &Path, bytes: &[u8]) -> io::Result<()> {
    write_with_mode(path, bytes, 0o600)
}

/// Like [`write_private`], readable by everyone (mode 0644): what is meant to be handed out.
pub fn write_public(path: &Path, bytes: &[u8]) -> io::Result<()> {
    write_with_mode(path, bytes, 0o644)
}

fn write_with_mode(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    run_store::atomic::write_with(dir, name, true, |file| {
        // Its mode before the first byte lands.
        file.set_permissions(Permissions::from_mode(mode))?;
        file.write_all(bytes)
    })
}

/// Creates a private folder (mode 0700) and its parents.
pub fn create_private_dir(dir: &Path) -> io::Result<()> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}
