//! Opening a file inside a run folder without leaving it: one path component at a time, never
//! following a symlink, refusing `..` and absolute paths. The supervisor's `collect` and the
//! agent's upload of a collected file both open it this way.
use crate::{Refusal, RunId, Store};
use std::ffi::{CString, OsStr};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path};

/// Why a file inside a run folder could not be opened: a one-line reason with its class.
#[derive(Debug)]
pub enum OpenError {
    /// The path would lead out of the run folder.
    Escapes(String),
    /// The path names something that is not a readable regular file inside the folder.
    Refused(String),
    /// The disk said no, while doing `what`.
    Io { what: String, cause: io::Error },
}

impl OpenError {
    /// The refusal class the supervisor exits with for this error.
    pub fn refusal(&self) -> Refusal {
        match self {
            OpenError::Escapes(_) => Refusal::PathEscapes,
            OpenError::Refused(_) => Refusal::Other,
            OpenError::Io { cause, .. } => Refusal::of_io(cause),
        }
    }
}

impl std::fmt::Display for OpenError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OpenError::Escapes(line) | OpenError::Refused(line) => f.write_str(line),
            OpenError::Io { what, cause } => {
                let class = Refusal::of_io(cause);
                write!(f, "{what}: {}{}", crate::describe_io(cause), class.advice())
            }
        }
    }
}

/// Opens the regular file `rel` inside run `id`'s folder for reading, refusing any path that
/// leaves it (`..`, absolute, or a symlink anywhere along the way).
pub fn open_in_run(store: &Store, id: &RunId, rel: &OsStr) -> Result<File, OpenError> {
    let run = id.as_str();
    let shown = rel.to_string_lossy();
    let rel_path = Path::new(rel);
    if rel.is_empty() {
        return Err(OpenError::Refused(
            "collect needs a --path inside the run folder".into(),
        ));
    }
    if rel_path.is_absolute() {
        return Err(OpenError::Escapes(format!(
            "path {shown:?} leaves the run folder: give a path relative to it, not an absolute one"
        )));
    }
    let mut names = Vec::new();
    for c in rel_path.components() {
        match c {
            Component::Normal(name) => names.push(name),
            Component::CurDir => {}
            _ => {
                return Err(OpenError::Escapes(format!(
                    "path {shown:?} leaves the run folder: `..` is not allowed"
                )));
            }
        }
    }
    let Some((last, folders)) = names.split_last() else {
        return Err(OpenError::Refused(format!(
            "path {shown:?} names the run folder itself: give a file inside it"
        )));
    };
    let io = |what: String| move |cause| OpenError::Io { what, cause };
    let run_dir = store.run_dir(id);
    let mut dir = open_nofollow(None, run_dir.as_os_str(), true)
        .map_err(io(format!("cannot open {}", run_dir.display())))?;
    // One component at a time, never following a link, so nothing can lead outside.
    for (n, name) in names.iter().enumerate() {
        let so_far = names[..=n]
            .iter()
            .map(|s| s.to_string_lossy())
            .collect::<Vec<_>>()
            .join("/");
        let is_last = n == folders.len();
        let refused = |line: String| Err(OpenError::Refused(line));
        match entry_at(&dir, name).map_err(io(format!("cannot read {so_far:?}")))? {
            Entry::Missing => {
                return refused(format!("path {shown:?} does not exist in run {run:?}"));
            }
            Entry::Symlink => {
                return Err(OpenError::Escapes(format!(
                    "path {shown:?} leaves the run folder through the symlink {so_far:?}: symlinks are not followed"
                )));
            }
            Entry::Directory if is_last => {
                return refused(format!("path {shown:?} is a folder: give a file"));
            }
            Entry::File | Entry::Directory => {}
            Entry::Other => return refused(format!("path {shown:?} is not a regular file")),
        }
        if !is_last {
            dir = open_nofollow(Some(&dir), name, true)
                .map_err(io(format!("cannot open {so_far:?} in run {run:?}")))?;
        }
    }
    let fd = open_nofollow(Some(&dir), last, false)
        .map_err(io(format!("cannot open {shown:?} in run {run:?}")))?;
    let file = File::from(fd);
    if !file.metadata().is_ok_and(|m| m.is_file()) {
        return Err(OpenError::Refused(format!(
            "path {shown:?} is not a regular file"
        )));
    }
    Ok(file)
}

/// What a path component inside a folder is, without following a symlink.
enum Entry {
    Missing,
    Symlink,
    Directory,
    File,
    Other,
}

fn c_name(name: &OsStr) -> io::Result<CString> {
    CString::new(name.as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "name holds a NUL byte"))
}

/// Looks at `name` inside the folder `dir` without following it.
fn entry_at(dir: &OwnedFd, name: &OsStr) -> io::Result<Entry> {
    let name = c_name(name)?;
    // SAFETY: stat is plain data filled by fstatat; the name outlives the call.
    unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        if libc::fstatat(
            dir.as_raw_fd(),
            name.as_ptr(),
            &mut st,
            libc::AT_SYMLINK_NOFOLLOW,
        ) < 0
        {
            let e = io::Error::last_os_error();
            return match e.kind() {
                io::ErrorKind::NotFound => Ok(Entry::Missing),
                _ => Err(e),
            };
        }
        Ok(match st.st_mode & libc::S_IFMT {
            libc::S_IFLNK => Entry::Symlink,
            libc::S_IFDIR => Entry::Directory,
            libc::S_IFREG => Entry::File,
            _ => Entry::Other,
        })
    }
}

/// Opens `name` inside `dir` (or `dir` itself as a path when `dir` is None), never following a
/// symlink, as a folder or a file to read.
fn open_nofollow(dir: Option<&OwnedFd>, name: &OsStr, directory: bool) -> io::Result<OwnedFd> {
    let name = c_name(name)?;
    let mut flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK;
    if directory {
        flags |= libc::O_DIRECTORY;
    }
    let at = dir.map_or(libc::AT_FDCWD, |d| d.as_raw_fd());
    // SAFETY: the name outlives the call; the returned fd is fresh.
    let fd = unsafe { libc::openat(at, name.as_ptr(), flags) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the fd is fresh and owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}
