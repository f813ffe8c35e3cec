//! `stage FILE`: copies a program into `store/sha256/<hex>` once, read-only and executable.
use super::io_line;
use anyhow::Result;
use run_store::{Digest, Store, atomic};
use sha2::{Digest as _, Sha256};
use std::fs::{self, File, Permissions};
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

pub fn run(store: &Store, file: &Path) -> Result<()> {
    let mut src = File::open(file).map_err(io_line(format!("cannot read {}", file.display())))?;
    let dir = store.programs_dir();
    fs::create_dir_all(&dir).map_err(io_line(format!("cannot create {}", dir.display())))?;
    // Copied under a temporary name while hashed, then renamed to its digest.
    let staging = format!("staging-{}", std::process::id());
    let digest = atomic::write_with(&dir, &staging, true, |out| {
        let mut hasher = Sha256::new();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = src.read(&mut buf)?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            out.write_all(&buf[..n])?;
        }
        out.set_permissions(Permissions::from_mode(0o555))?;
        Ok(Digest::from_hasher(hasher))
    })
    .map_err(io_line(format!(
        "cannot stage {} into {}",
        file.display(),
        dir.display()
    )))?;
    let staged = dir.join(&staging);
    let target = store.program_path(&digest);
    // Copied once: an intact earlier copy stays; a damaged one is replaced.
    let intact = File::open(&target)
        .and_then(Digest::of_reader)
        .is_ok_and(|d| d == digest);
    if intact {
        let _ = fs::remove_file(&staged);
    } else {
        fs::rename(&staged, &target)
            .map_err(io_line(format!("cannot stage {}", target.display())))?;
        atomic::sync_dir(&dir).map_err(io_line(format!("cannot sync {}", dir.display())))?;
    }
    println!("{digest}");
    Ok(())
}
