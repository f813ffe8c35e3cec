//! Holding a run's process tree together and ending all of it: a cgroup v2 with `cgroup.kill`
//! where one can be created, always a process group, and (as subreaper) a scan of every
//! descendant, repeated until none is left, so setsid'd and double-forked daemons die too.
use crate::sys;
use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::fd::{AsRawFd, RawFd};
use std::path::PathBuf;

/// A cgroup made for one run.
pub struct Cgroup {
    dir: PathBuf,
    /// The folder itself, for clone3's CLONE_INTO_CGROUP.
    handle: File,
    /// `cgroup.procs`, opened before the fork so a forked child can join with one write.
    procs: File,
}

impl Cgroup {
    /// A fresh child of this process's cgroup v2, or None where that is not possible
    /// (no cgroup2 mount, not delegated to us, or no `cgroup.kill` before Linux 5.14).
    pub fn create() -> Option<Cgroup> {
        let own = fs::read_to_string("/proc/self/cgroup").ok()?;
        let own = own.lines().find_map(|l| l.strip_prefix("0::"))?.to_string();
        let (mount, mount_root) = cgroup2_mount()?;
        let relative = own.strip_prefix(mount_root.as_str()).unwrap_or(&own);
        let dir = PathBuf::from(mount)
            .join(relative.trim_start_matches('/'))
            .join(format!("fleet-run.{}", std::process::id()));
        // A leftover from a dead supervisor that had our pid is empty and can go.
        let _ = fs::remove_dir(&dir);
        fs::create_dir(&dir).ok()?;
        let procs = OpenOptions::new()
            .write(true)
            .open(dir.join("cgroup.procs"));
        let handle = File::open(&dir);
        match (procs, handle) {
            (Ok(procs), Ok(handle)) if dir.join("cgroup.kill").exists() => {
                Some(Cgroup { dir, handle, procs })
            }
            _ => {
                let _ = fs::remove_dir(&dir);
                None
            }
        }
    }

    /// The fd clone3 places the child with.
    pub fn dir_fd(&self) -> RawFd {
        self.handle.as_raw_fd()
    }

    /// The fd a forked child writes "0" to, between fork and exec, to move itself in.
    pub fn procs_fd(&self) -> RawFd {
        self.procs.as_raw_fd()
    }

    fn members(&self) -> Vec<libc::pid_t> {
        fs::read_to_string(self.dir.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }

    fn kill_all(&self) {
        if let Ok(mut f) = OpenOptions::new()
            .write(true)
            .open(self.dir.join("cgroup.kill"))
        {
            let _ = f.write_all(b"1");
        }
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        // Empty once every member is reaped; the kernel may lag a moment behind.
        for _ in 0..50 {
            if fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
    }
}

/// Where cgroup2 is mounted, and which cgroup is that mount's root.
fn cgroup2_mount() -> Option<(String, String)> {
    let info = fs::read_to_string("/proc/self/mountinfo").ok()?;
    info.lines().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        if right.split_whitespace().next()? != "cgroup2" {
            return None;
        }
        let mut f = left.split_whitespace();
        let root = f.nth(3)?.to_string();
        let mount = f.next()?.to_string();
        Some((mount, root))
    })
}

/// A run's process tree: the program's process group, this supervisor's descendants, and the
/// cgroup when there is one.
pub struct Tree {
    pub cgroup: Option<Cgroup>,
    /// The program's pid, which is also its process group id; None once reaped, since the
    /// number may then be reused by an unrelated group.
    pub leader: Option<libc::pid_t>,
    /// Orphans are reparented to us, so "no child left" means "no descendant left".
    pub subreaper: bool,
}

impl Tree {
    pub fn containment(&self) -> &'static str {
        if self.cgroup.is_some() {
            "cgroup"
        } else {
            "process-group"
        }
    }

    /// Whether nothing of the tree is left, once this process has no child: as subreaper that
    /// is already certain; otherwise only the cgroup can tell (without one, orphans escape).
    pub fn is_empty(&self) -> bool {
        self.subreaper
            || self
                .cgroup
                .as_ref()
                .is_none_or(|cg| cg.members().is_empty())
    }

    /// Sends `signal` to every process of the tree that exists right now.
    pub fn signal(&self, signal: libc::c_int) {
        if signal == libc::SIGKILL
            && let Some(cg) = &self.cgroup
        {
            cg.kill_all();
        }
        if let Some(leader) = self.leader {
            sys::kill(-leader, signal);
        }
        if let Some(cg) = &self.cgroup {
            for pid in cg.members() {
                sys::kill(pid, signal);
            }
        }
        for pid in descendants(std::process::id() as libc::pid_t) {
            sys::kill(pid, signal);
        }
    }
}

/// Every live descendant of `root`, found by a scan of /proc (parents before children).
pub fn descendants(root: libc::pid_t) -> Vec<libc::pid_t> {
    let mut children: HashMap<libc::pid_t, Vec<libc::pid_t>> = HashMap::new();
    if let Ok(entries) = fs::read_dir("/proc") {
        for entry in entries.flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse().ok()) else {
                continue;
            };
            if let Some(ppid) = parent_of(pid) {
                children.entry(ppid).or_default().push(pid);
            }
        }
    }
    let mut out = Vec::new();
    let mut queue = vec![root];
    while let Some(pid) = queue.pop() {
        for &child in children.get(&pid).map(Vec::as_slice).unwrap_or_default() {
            out.push(child);
            queue.push(child);
        }
    }
    out
}

fn parent_of(pid: libc::pid_t) -> Option<libc::pid_t> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name: state, then ppid.
    stat.get(stat.rfind(')')? + 1..)?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}
