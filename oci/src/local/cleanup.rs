//! What an interrupted command must not leave behind: its temporary files and a layout it created.
//!
//! Every writer registers what it makes here. [`install`] (called first thing by the binary) blocks
//! SIGINT and SIGTERM in every thread and waits for them on one thread of its own, which removes what
//! is registered and then dies of the same signal. A SIGKILL cannot be caught: what it leaves is
//! swept by the next writer of the layout (see `layout.rs`, temporary files are locked by their owner).
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

/// Paths to remove if the process is interrupted.
#[derive(Debug, Default)]
pub struct Registry {
    temps: BTreeSet<PathBuf>,
    /// Layouts this command created, with whether it made the directory itself (else it was empty).
    layouts: Vec<(PathBuf, bool)>,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
    temps: BTreeSet::new(),
    layouts: Vec::new(),
});

/// The registry, held while a temporary file is created or renamed, so an interrupt sees either
/// the temporary file or the finished one, never a file it does not know about.
pub fn registry() -> MutexGuard<'static, Registry> {
    // A panic while holding it leaves plain paths behind; they are still worth cleaning.
    REGISTRY.lock().unwrap_or_else(|e| e.into_inner())
}

impl Registry {
    pub fn add_temp(&mut self, path: &Path) {
        self.temps.insert(path.to_path_buf());
    }

    pub fn remove_temp(&mut self, path: &Path) {
        self.temps.remove(path);
    }

    pub fn add_layout(&mut self, dir: &Path, made_dir: bool) {
        self.layouts.push((dir.to_path_buf(), made_dir));
    }

    pub fn remove_layout(&mut self, dir: &Path) {
        self.layouts.retain(|(d, _)| d != dir);
    }

    /// Removes everything registered (best effort: the process is on its way out).
    fn remove_all(&self) {
        for temp in &self.temps {
            let _ = std::fs::remove_file(temp);
        }
        for (dir, made_dir) in &self.layouts {
            remove_layout(dir, *made_dir);
        }
    }
}

/// Takes back a layout a command created: the directory if it made it, else what it put in it.
pub fn remove_layout(dir: &Path, made_dir: bool) {
    if made_dir {
        let _ = std::fs::remove_dir_all(dir);
    } else {
        for name in ["oci-layout", "index.json"] {
            let _ = std::fs::remove_file(dir.join(name));
        }
        let _ = std::fs::remove_dir_all(dir.join("blobs"));
    }
}

fn interrupt_set() -> libc::sigset_t {
    // SAFETY: sigemptyset and sigaddset only write the set they are given.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        set
    }
}

/// Blocks SIGINT and SIGTERM in this thread and every thread started after, and starts the thread
/// that receives them: it removes what is registered, then re-raises the signal with its default
/// action, so the exit status still says which signal ended the command. Call before any thread starts.
pub fn install() {
    let set = interrupt_set();
    // SAFETY: pthread_sigmask only reads the set; no other thread exists yet.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    std::thread::spawn(move || {
        let mut signal = 0;
        // SAFETY: sigwait reads the set and writes the signal number.
        if unsafe { libc::sigwait(&set, &mut signal) } != 0 {
            return;
        }
        // Held until the process ends: no other thread registers or renames anything after this.
        let registry = registry();
        registry.remove_all();
        // SAFETY: restoring the default action and raising the signal in this thread, where it is
        // unblocked, ends the process as the signal would have.
        unsafe {
            libc::signal(signal, libc::SIG_DFL);
            libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
            libc::raise(signal);
        }
        std::process::exit(128 + signal);
    });
}

/// Unblocks SIGINT and SIGTERM again, for a child process about to exec (the mask is inherited).
/// Only async-signal-safe calls: it runs between fork and exec.
pub fn unblock_for_child() -> std::io::Result<()> {
    let set = interrupt_set();
    // SAFETY: pthread_sigmask is async-signal-safe and only reads the set.
    unsafe { libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut()) };
    Ok(())
}
