//! A run's liveness: whoever owns a run holds an exclusive `flock` on its folder, from before
//! the folder appears in runs/ until its result is durable. The kernel lets go of it exactly
//! when the last process holding it is gone, crash or reboot included, so a reader that finds
//! the lock free and no result knows the run is lost, with no pid to reuse and no race.
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;

/// Takes the run's lock on a folder not yet visible to anyone; it is held for as long as any
/// process keeps the fd (a fork shares it), and it is close-on-exec, so no program inherits it.
pub fn hold(dir: &Path) -> io::Result<File> {
    let folder = File::open(dir)?;
    flock(&folder, libc::LOCK_EX | libc::LOCK_NB)?;
    Ok(folder)
}

/// Someone owns the run behind this open folder right now.
pub fn is_held(folder: &File) -> io::Result<bool> {
    match flock(folder, libc::LOCK_SH | libc::LOCK_NB) {
        Ok(()) => {
            flock(folder, libc::LOCK_UN)?;
            Ok(false)
        }
        Err(e) if e.raw_os_error() == Some(libc::EWOULDBLOCK) => Ok(true),
        Err(e) => Err(e),
    }
}

/// Blocks until nobody owns the run in `dir` any more.
pub fn wait_released(dir: &Path) -> io::Result<()> {
    flock(&File::open(dir)?, libc::LOCK_SH)
}

fn flock(file: &File, how: libc::c_int) -> io::Result<()> {
    loop {
        // SAFETY: an fd we hold and a flag set; no memory is shared.
        if unsafe { libc::flock(file.as_raw_fd(), how) } == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}
