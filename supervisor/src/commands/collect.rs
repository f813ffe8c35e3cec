//! `collect`: copies one regular file out of a run folder, refusing any path that leaves it
//! (`..`, absolute, or a symlink anywhere along the way), and prints its sha256.
use super::{io_line, refuse};
use anyhow::{Result, bail};
use run_store::{Digest, RunId, Store, atomic, inside};
use sha2::{Digest as _, Sha256};
use std::ffi::OsStr;
use std::io::{Read, Write};
use std::path::Path;

pub fn run(store: &Store, run: &str, rel: &OsStr, out: &Path) -> Result<()> {
    let id = RunId::parse(run)?;
    store.status(&id)?;
    let mut src = inside::open_in_run(store, &id, rel).map_err(|e| refuse(e.refusal(), e))?;
    let out_dir = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let Some(out_name) = out.file_name().and_then(|n| n.to_str().map(str::to_string)) else {
        bail!("bad --out {}: give a file name", out.display());
    };
    let digest = atomic::write_with(out_dir, &out_name, true, |dst| {
        let mut hasher = Sha256::new();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = src.read(&mut buf)?;
            if n == 0 {
                return Ok(Digest::from_hasher(hasher));
            }
            hasher.update(&buf[..n]);
            dst.write_all(&buf[..n])?;
        }
    })
    .map_err(io_line(format!("cannot write {}", out.display())))?;
    println!("{digest}");
    Ok(())
}
