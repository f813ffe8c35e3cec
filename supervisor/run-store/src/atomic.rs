//! Writing a file so that a reader sees either nothing or all of it: temp file, fsync, rename,
//! fsync the folder.
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
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
        commit(&file, &tmp, dir, name, durable)?;
        Ok(value)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Durably replaces `dir/name` with `bytes`, using the existing `dir/over` as the temporary
/// file: its bytes are replaced (never through a symlink) and it is renamed to `name`, so no
/// inode is allocated (on some disks the dearest step). Without a plain `over`, a fresh
/// temporary file is used. A crash midway leaves `over` damaged and `name` absent.
pub fn write_over(dir: &Path, over: &str, name: &str, bytes: &[u8]) -> io::Result<()> {
    let path = dir.join(over);
    let opened = OpenOptions::new()
        .write(true)
        .truncate(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&path);
    let mut file = match opened {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ELOOP) => {
            return write(dir, name, bytes, true);
        }
        Err(e) => return Err(e),
    };
    file.write_all(bytes)?;
    commit(&file, &path, dir, name, true)
}

/// The end of every replacement: fsync the new content, rename it into place, fsync the folder.
fn commit(file: &File, from: &Path, dir: &Path, name: &str, durable: bool) -> io::Result<()> {
    if durable {
        file.sync_all()?;
    }
    fs::rename(from, dir.join(name))?;
    if durable {
        sync_dir(dir)?;
    }
    Ok(())
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
