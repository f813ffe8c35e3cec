//! `collect`: copies one regular file out of a run folder, refusing any path that leaves it
//! (`..`, absolute, or a symlink anywhere along the way), and prints its sha256.
use super::{io_line, refuse};
use crate::sys::{self, Entry};
use anyhow::{Result, bail};
use run_store::{Digest, Refusal, RunId, Store, atomic};
use sha2::{Digest as _, Sha256};
use std::ffi::OsStr;
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Component, Path};

pub fn run(store: &Store, run: &str, rel: &OsStr, out: &Path) -> Result<()> {
    let id = RunId::parse(run)?;
    store.status(&id)?;
    let shown = rel.to_string_lossy();
    let rel_path = Path::new(rel);
    if rel.is_empty() {
        bail!("collect needs a --path inside the run folder");
    }
    if rel_path.is_absolute() {
        return Err(refuse(
            Refusal::PathEscapes,
            format!(
                "path {shown:?} leaves the run folder: give a path relative to it, not an absolute one"
            ),
        ));
    }
    let mut names = Vec::new();
    for c in rel_path.components() {
        match c {
            Component::Normal(name) => names.push(name),
            Component::CurDir => {}
            _ => {
                return Err(refuse(
                    Refusal::PathEscapes,
                    format!("path {shown:?} leaves the run folder: `..` is not allowed"),
                ));
            }
        }
    }
    let Some((last, folders)) = names.split_last() else {
        bail!("path {shown:?} names the run folder itself: give a file inside it");
    };
    let run_dir = store.run_dir(&id);
    let mut dir = sys::open_nofollow(None, run_dir.as_os_str(), true)
        .map_err(io_line(format!("cannot open {}", run_dir.display())))?;
    // One component at a time, never following a link, so nothing can lead outside.
    for (n, name) in names.iter().enumerate() {
        let so_far = names[..=n]
            .iter()
            .map(|s| s.to_string_lossy())
            .collect::<Vec<_>>()
            .join("/");
        let is_last = n == folders.len();
        match sys::entry_at(&dir, name).map_err(io_line(format!("cannot read {so_far:?}")))? {
            Entry::Missing => bail!("path {shown:?} does not exist in run {run:?}"),
            Entry::Symlink => {
                return Err(refuse(
                    Refusal::PathEscapes,
                    format!(
                        "path {shown:?} leaves the run folder through the symlink {so_far:?}: symlinks are not followed"
                    ),
                ));
            }
            Entry::Directory if is_last => bail!("path {shown:?} is a folder: give a file"),
            Entry::File | Entry::Directory => {}
            Entry::Other => bail!("path {shown:?} is not a regular file"),
        }
        if !is_last {
            dir = sys::open_nofollow(Some(&dir), name, true)
                .map_err(io_line(format!("cannot open {so_far:?} in run {run:?}")))?;
        }
    }
    let fd = sys::open_nofollow(Some(&dir), last, false)
        .map_err(io_line(format!("cannot open {shown:?} in run {run:?}")))?;
    let mut src = File::from(fd);
    if !src.metadata().is_ok_and(|m| m.is_file()) {
        bail!("path {shown:?} is not a regular file");
    }
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
