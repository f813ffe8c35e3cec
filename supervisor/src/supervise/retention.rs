//! Retention: after each finish, keep only the newest N finished runs; running and lost runs
//! are never removed.
//!
//! Each finish first leaves a marker `finished/<nanoseconds since the epoch>-<run>`,
//! then writes its result.json, so one listing of `finished/` orders the finished runs without
//! opening any of them: a finish costs one directory read, not a stat of every run. The marker
//! is not fsynced: a journaling filesystem commits metadata in order, so a durable result
//! implies a durable marker. A marker whose run is not final is either a finish in flight
//! (counted, since it is about to be) or a supervisor that died between the two (its run reads
//! as lost and stays; the marker is dropped).
use run_store::layout::OWNER_FILE;
use run_store::{Error, RunId, State, Store};
use std::ffi::OsStr;
use std::fs;
use std::io;
use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

/// Records that `id` is finishing now; returns the marker, to be taken back should its
/// result never be written. The marker is a hard link to the run's owner file: a new name for
/// an existing inode, since allocating an inode is the dearest step of a small write on some
/// disks.
pub fn mark(store: &Store, id: &RunId) -> io::Result<PathBuf> {
    let dir = store.finished_dir();
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let marker = dir.join(format!("{nanos:020}-{id}"));
    fs::create_dir_all(&dir)?;
    // Without an owner to link to (or hard links), an empty file does as well.
    if fs::hard_link(store.run_dir(id).join(OWNER_FILE), &marker).is_err() {
        fs::File::create(&marker)?;
    }
    Ok(marker)
}

pub fn prune(store: &Store, keep: usize) {
    let dir = store.finished_dir();
    let Ok(entries) = fs::read_dir(&dir) else {
        return;
    };
    let mut markers: Vec<String> = entries
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    if markers.len() <= keep {
        return;
    }
    // Fixed-width timestamps: the names sort oldest first.
    markers.sort_unstable();
    let mut counted = markers.len();
    for (n, marker) in markers.iter().enumerate() {
        if counted <= keep {
            break;
        }
        let id = marker
            .split_once('-')
            .and_then(|(_, id)| RunId::parse(id).ok());
        let status = id.as_ref().map(|id| store.status(id));
        let drop_marker = match status {
            Some(Ok(s)) if s.state == State::Lost => true,
            Some(Ok(s)) if s.state.is_final() => remove(store, s.id.as_str().as_ref(), n).is_ok(),
            // Being written right now: it counts, and a newer run goes instead.
            Some(Ok(_)) => false,
            // Removed by hand, or not a marker of ours.
            Some(Err(Error::UnknownRun { .. })) | None => true,
            Some(Err(_)) => false,
        };
        if drop_marker {
            let _ = fs::remove_file(dir.join(marker));
            counted -= 1;
        }
    }
}

/// Removes the run folder `runs/<name>`, renamed into tmp/ first so no reader ever sees a
/// half-removed run; `n` tells apart several removals by one process. Once renamed the run is
/// gone for every reader, even if deleting its files then fails.
pub fn remove(store: &Store, name: &OsStr, n: usize) -> io::Result<()> {
    let gone = store.tmp_dir().join(format!(
        "gone-{}-{}-{n}",
        std::process::id(),
        name.to_string_lossy()
    ));
    fs::rename(store.runs_dir().join(name), &gone)?;
    let _ = fs::remove_dir_all(&gone);
    Ok(())
}
