//! Retention: after each finish, keep only the newest N finished runs (by when their result
//! was written); running and lost runs are never removed.
use run_store::Store;
use run_store::layout::RESULT_FILE;
use std::ffi::OsStr;
use std::fs;
use std::io;
use std::time::SystemTime;

pub fn prune(store: &Store, keep: usize) {
    let runs = store.runs_dir();
    let Ok(entries) = fs::read_dir(&runs) else {
        return;
    };
    let names: Vec<_> = entries.flatten().map(|e| e.file_name()).collect();
    // Cheap common case: fewer runs than the limit, no need to look inside any.
    if names.len() <= keep {
        return;
    }
    let mut finished: Vec<(SystemTime, std::ffi::OsString)> = names
        .into_iter()
        .filter_map(|name| {
            let at = fs::metadata(runs.join(&name).join(RESULT_FILE))
                .and_then(|m| m.modified())
                .ok()?;
            Some((at, name))
        })
        .collect();
    if finished.len() <= keep {
        return;
    }
    finished.sort();
    let excess = finished.len() - keep;
    for (n, (_, name)) in finished.into_iter().take(excess).enumerate() {
        let _ = remove(store, &name, n);
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
