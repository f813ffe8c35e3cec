//! Writing a file so that a reader sees either nothing or all of it: temp file, fsync, rename,
//! fsync the folder.
use std::fs::{self, File};
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
        let mut file = File::create(&tmp)?;
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
