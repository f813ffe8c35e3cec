//! Retention: after each finish, keep only the newest N finished runs (by when their result
//! was written); running and lost runs are never removed.
use run_store::Store;
use run_store::layout::RESULT_FILE;
use std::fs;
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
        // Renamed away first, so no reader ever sees a half-removed run.
        let gone = store.tmp_dir().join(format!(
            "gone-{}-{}-{n}",
            std::process::id(),
            name.to_string_lossy()
        ));
        if fs::rename(runs.join(&name), &gone).is_ok() {
            let _ = fs::remove_dir_all(&gone);
        }
    }
}
