//! Writing a file so that a reader sees either nothing or all of it: temp file, fsync, rename,
//! fsync the folder.
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::Path;

/// Replaces `dir/name` with `bytes`; when `durable`, the new content survives a power cut.
pub fn write(dir: &Path, name: &str, bytes: &[u8], durable: bool) -> io::Result<()> {
    write_with(dir, name, durable, |file| file.write_all(bytes))
}

/// Replaces `dir/name` with what `fill` writes into a fresh temporary file; nothing appears
/// under `name` unless `fill` and the rename succeed.
pub fn write_with<T>(
    dir: &Path,
    name: &str,
    durable: bool,
    fill: impl FnOnce(&mut File) -> io::Result<T>,
) -> io::Result<T> {
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let result = (|| {
        let mut file = create_new(&tmp)?;
        let value = fill(&mut file)?;
        if durable {
            file.sync_all()?;
        }
        fs::rename(&tmp, dir.join(name))?;
        if durable {
            sync_dir(dir)?;
        }
        Ok(value)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Makes a folder's entries (a rename into it) durable.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Creates `path` afresh, never through whatever already has its name (a stale temporary file
/// or a symlink a program left in its folder): that name is removed first.
fn create_new(path: &Path) -> io::Result<File> {
    let open = || OpenOptions::new().write(true).create_new(true).open(path);
    match open() {
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            fs::remove_file(path)?;
            open()
        }
        other => other,
    }
}
