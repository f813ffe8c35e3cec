//! The kernel calls the supervisor makes beyond std, each behind a small safe wrapper.
use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

fn check(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

fn cstr(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path holds a NUL byte"))
}

pub enum Forked {
    Parent(libc::pid_t),
    Child,
}

/// Forks. Callers are single-threaded, so the child may do anything the parent could.
pub fn fork() -> io::Result<Forked> {
    // SAFETY: the process has one thread; the child only continues ordinary Rust code.
    match check(unsafe { libc::fork() })? {
        0 => Ok(Forked::Child),
        pid => Ok(Forked::Parent(pid)),
    }
}

/// Leaves the caller's session and controlling terminal.
pub fn setsid() -> io::Result<()> {
    // SAFETY: no pointers involved.
    check(unsafe { libc::setsid() }).map(drop)
}

/// Ends this process at once, without running exit handlers (a forked child that cannot exec).
pub fn exit_now(code: i32) -> ! {
    // SAFETY: _exit never returns and touches no Rust state.
    unsafe { libc::_exit(code) }
}

/// Orphaned descendants are reparented to this process instead of init.
pub fn set_child_subreaper() -> io::Result<()> {
    // SAFETY: plain prctl with integer arguments.
    check(unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) }).map(drop)
}

/// Points fds 0, 1 and 2 at /dev/null and closes every other fd but those in `keep`
/// (negative entries are ignored).
pub fn detach_fds(keep: &[RawFd]) -> io::Result<()> {
    let null = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")?;
    for fd in 0..3 {
        // SAFETY: dup2 onto the standard fds; `null` stays open until the loop ends.
        check(unsafe { libc::dup2(null.as_raw_fd(), fd) })?;
    }
    drop(null);
    let mut keep: Vec<u32> = keep
        .iter()
        .filter(|&&fd| fd > 2)
        .map(|&fd| fd as u32)
        .collect();
    keep.sort_unstable();
    // Best effort: without close_range (old kernels, emulators) stray fds merely stay open.
    let mut from = 3u32;
    for fd in keep.into_iter().chain([u32::MAX]) {
        if fd > from {
            // SAFETY: close_range takes plain integers; the fds in the range are not ours to use.
            unsafe {
                libc::syscall(libc::SYS_close_range, from, fd - 1, 0u32);
            }
        }
        from = from.max(fd.saturating_add(1));
    }
    Ok(())
}

/// A pipe whose ends close on exec.
pub fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two fds into the array.
    check(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) })?;
    // SAFETY: both fds are fresh and owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Renames `from` to `to` only if `to` does not exist (the atomic claim of a run id).
/// Falls back to a plain rename where the filesystem lacks RENAME_NOREPLACE; that is still
/// safe for folders because a claimed run folder is never empty.
pub fn rename_noreplace(from: &Path, to: &Path) -> io::Result<()> {
    let (f, t) = (cstr(from)?, cstr(to)?);
    // SAFETY: both strings outlive the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            libc::AT_FDCWD,
            f.as_ptr(),
            libc::AT_FDCWD,
            t.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The signals the supervisor handles itself: a child's end, and being asked to stop.
pub const HANDLED: &[libc::c_int] = &[libc::SIGCHLD, libc::SIGTERM, libc::SIGINT, libc::SIGHUP];

/// Blocks `signals` and returns a non-blocking signalfd that reads them.
/// A spawned child starts with an empty mask again (std resets it).
pub fn signalfd(signals: &[libc::c_int]) -> io::Result<OwnedFd> {
    // SAFETY: sigset_t is plain data initialised by sigemptyset before use.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for &s in signals {
            libc::sigaddset(&mut set, s);
        }
        check(libc::sigprocmask(
            libc::SIG_BLOCK,
            &set,
            std::ptr::null_mut(),
        ))?;
        let fd = check(libc::signalfd(
            -1,
            &set,
            libc::SFD_NONBLOCK | libc::SFD_CLOEXEC,
        ))?;
        Ok(OwnedFd::from_raw_fd(fd))
    }
}

/// The next pending signal on a signalfd, if any.
pub fn read_signal(fd: &OwnedFd) -> Option<libc::c_int> {
    // SAFETY: signalfd_siginfo is plain data; read fills at most its size.
    unsafe {
        let mut info: libc::signalfd_siginfo = std::mem::zeroed();
        let size = std::mem::size_of::<libc::signalfd_siginfo>();
        let n = libc::read(fd.as_raw_fd(), (&raw mut info).cast(), size);
        (n == size as isize).then_some(info.ssi_signo as libc::c_int)
    }
}

/// Waits up to `timeout_ms` (-1: forever) for any of `fds` to be readable or hung up;
/// returns which were.
pub fn poll_readable(fds: &[RawFd], timeout_ms: i32) -> io::Result<Vec<bool>> {
    let mut pfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    // SAFETY: the array is valid for its length.
    let rc = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, timeout_ms) };
    if rc < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(vec![false; fds.len()]);
        }
        return Err(e);
    }
    Ok(pfds.iter().map(|p| p.revents != 0).collect())
}

/// How a reaped process ended.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Ended {
    Code(i32),
    Signal(i32),
}

pub enum Reaped {
    One(libc::pid_t, Ended),
    /// Children exist but none has ended.
    NoneYet,
    /// No child is left at all.
    NoChildren,
}

/// Reaps one ended child of this process without blocking.
pub fn reap_any() -> Reaped {
    let mut status = 0;
    // SAFETY: status is a valid out-pointer.
    let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
    match pid {
        0 => Reaped::NoneYet,
        p if p > 0 => {
            let ended = if libc::WIFSIGNALED(status) {
                Ended::Signal(libc::WTERMSIG(status))
            } else {
                Ended::Code(libc::WEXITSTATUS(status))
            };
            Reaped::One(p, ended)
        }
        _ if io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) => Reaped::NoneYet,
        _ => Reaped::NoChildren,
    }
}

/// Waits for one specific child (a child that failed to exec).
pub fn wait_pid(pid: libc::pid_t) {
    let mut status = 0;
    // SAFETY: status is a valid out-pointer.
    while unsafe { libc::waitpid(pid, &mut status, 0) } < 0
        && io::Error::last_os_error().raw_os_error() == Some(libc::EINTR)
    {}
}

/// Sends a signal to a process (`pid` > 0) or a process group (`pid` < 0); a gone target is
/// not an error.
pub fn kill(pid: libc::pid_t, signal: libc::c_int) {
    // SAFETY: plain integers.
    unsafe {
        libc::kill(pid, signal);
    }
}

/// Sends a signal, reporting whether the target existed.
pub fn signal_exists(pid: libc::pid_t, signal: libc::c_int) -> bool {
    // SAFETY: plain integers.
    unsafe { libc::kill(pid, signal) == 0 }
}

/// Writes all of `bytes` to a raw fd, with no allocation (safe between fork and exec).
pub fn write_raw(fd: RawFd, bytes: &[u8]) -> io::Result<()> {
    // SAFETY: the slice is valid for its length.
    let n = unsafe { libc::write(fd, bytes.as_ptr().cast(), bytes.len()) };
    if n == bytes.len() as isize {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// A started program: its pid and the read ends of its stdout and stderr.
pub struct Spawned {
    pub pid: libc::pid_t,
    pub stdout: OwnedFd,
    pub stderr: OwnedFd,
}

/// Where a spawned program goes: its folder, and the cgroup it starts in.
pub struct Placement<'a> {
    pub dir: &'a CString,
    /// The cgroup folder's fd, for clone3's CLONE_INTO_CGROUP (no slow migration).
    pub cgroup_dir: Option<RawFd>,
    /// `cgroup.procs`, for the child to join by itself where clone3 is missing.
    pub cgroup_procs: Option<RawFd>,
}

/// Starts `exec` in a new process group with stdin on /dev/null and stdout/stderr on fresh
/// pipes. Returns once the program was exec'd; an exec failure comes back as the error.
pub fn spawn(exec: &Exec, place: &Placement) -> io::Result<Spawned> {
    let null = std::fs::File::open("/dev/null")?;
    let (out_r, out_w) = pipe()?;
    let (err_r, err_w) = pipe()?;
    let (fail_r, fail_w) = pipe()?;
    let fds = [null.as_raw_fd(), out_w.as_raw_fd(), err_w.as_raw_fd()];
    let child = |procs: Option<RawFd>| -> ! {
        // In the child: syscalls only, on memory prepared before the clone.
        let errno = child_exec(exec, place.dir, fds, procs);
        let _ = write_raw(fail_w.as_raw_fd(), &errno.to_ne_bytes());
        exit_now(127)
    };
    let pid = match place.cgroup_dir.map(clone_into_cgroup) {
        Some(Ok(0)) => child(None),
        Some(Ok(pid)) => pid,
        // No clone3 (old kernel, emulator) or no cgroup: fork; the child joins by itself.
        _ => match fork()? {
            Forked::Child => child(place.cgroup_procs),
            Forked::Parent(pid) => pid,
        },
    };
    drop((null, out_w, err_w, fail_w));
    let mut errno = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        // SAFETY: the buffer is valid for the remaining length.
        let n = unsafe {
            libc::read(
                fail_r.as_raw_fd(),
                errno[got..].as_mut_ptr().cast(),
                4 - got,
            )
        };
        if n > 0 {
            got += n as usize;
        } else if n == 0 || io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            break;
        }
    }
    if got == 4 {
        wait_pid(pid);
        return Err(io::Error::from_raw_os_error(i32::from_ne_bytes(errno)));
    }
    Ok(Spawned {
        pid,
        stdout: out_r,
        stderr: err_r,
    })
}

/// clone3 with CLONE_INTO_CGROUP: like fork, but the child starts inside the cgroup.
fn clone_into_cgroup(cgroup: RawFd) -> io::Result<libc::pid_t> {
    #[repr(C)]
    struct CloneArgs {
        flags: u64,
        pidfd: u64,
        child_tid: u64,
        parent_tid: u64,
        exit_signal: u64,
        stack: u64,
        stack_size: u64,
        tls: u64,
        set_tid: u64,
        set_tid_size: u64,
        cgroup: u64,
    }
    const CLONE_INTO_CGROUP: u64 = 0x2_0000_0000;
    let args = CloneArgs {
        flags: CLONE_INTO_CGROUP,
        pidfd: 0,
        child_tid: 0,
        parent_tid: 0,
        exit_signal: libc::SIGCHLD as u64,
        stack: 0,
        stack_size: 0,
        tls: 0,
        set_tid: 0,
        set_tid_size: 0,
        cgroup: cgroup as u64,
    };
    // SAFETY: the process has one thread, and the child (as after fork) only makes syscalls
    // before it execs.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_clone3,
            &raw const args,
            std::mem::size_of::<CloneArgs>(),
        )
    };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc as libc::pid_t)
    }
}

/// The child's side of `spawn`; returns the errno of the step that failed.
fn child_exec(exec: &Exec, dir: &CString, fds: [RawFd; 3], procs: Option<RawFd>) -> i32 {
    let errno = || {
        io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO)
    };
    // SAFETY: plain syscalls on fds and strings that stay valid in the child.
    unsafe {
        for (target, fd) in fds.into_iter().enumerate() {
            if libc::dup2(fd, target as RawFd) < 0 {
                return errno();
            }
        }
        if let Some(procs) = procs {
            // Outside the cgroup the process group and the subreaper scan still hold it.
            libc::write(procs, b"0".as_ptr().cast(), 1);
        }
        if libc::chdir(dir.as_ptr()) < 0 || libc::setpgid(0, 0) < 0 {
            return errno();
        }
        // A program starts with no blocked signals and default dispositions (std ignores
        // SIGPIPE for itself).
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigprocmask(libc::SIG_SETMASK, &set, std::ptr::null_mut());
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        // The program dies with its supervisor rather than running on unrecorded.
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
    }
    exec.exec().raw_os_error().unwrap_or(libc::EIO)
}

/// A program, argv and environment laid out for execve before the fork, so that the child
/// allocates nothing between fork and exec.
pub struct Exec {
    program: CString,
    _strings: Vec<CString>,
    argv: Vec<*const libc::c_char>,
    envp: Vec<*const libc::c_char>,
}

// SAFETY: the pointers point into `_strings`, which the struct owns and never changes.
unsafe impl Send for Exec {}
// SAFETY: as above; nothing is mutated through the pointers.
unsafe impl Sync for Exec {}

impl Exec {
    /// None when a string holds a NUL byte, which execve cannot pass.
    pub fn new(program: &[u8], argv: &[&[u8]], envp: &[Vec<u8>]) -> Option<Exec> {
        let program = CString::new(program).ok()?;
        let argc = argv.len();
        let strings: Vec<CString> = argv
            .iter()
            .copied()
            .chain(envp.iter().map(Vec::as_slice))
            .map(|s| CString::new(s).ok())
            .collect::<Option<_>>()?;
        let ptrs = |range: &[CString]| {
            range
                .iter()
                .map(|s| s.as_ptr())
                .chain([std::ptr::null()])
                .collect()
        };
        Some(Exec {
            program,
            argv: ptrs(&strings[..argc]),
            envp: ptrs(&strings[argc..]),
            _strings: strings,
        })
    }

    /// execve; returns only on failure.
    pub fn exec(&self) -> io::Error {
        // SAFETY: both arrays end in a null pointer and point at strings `self` keeps alive.
        unsafe {
            libc::execve(
                self.program.as_ptr(),
                self.argv.as_ptr(),
                self.envp.as_ptr(),
            );
        }
        io::Error::last_os_error()
    }
}

/// Bytes an unprivileged writer may still use on the filesystem holding `file`.
pub fn available_bytes(file: &std::fs::File) -> io::Result<u64> {
    // SAFETY: statvfs is plain data, filled in by the kernel.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid fd and a pointer to a struct of the right type.
    check(unsafe { libc::fstatvfs(file.as_raw_fd(), &mut st) })?;
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}

/// A signal's name for people (`SIGTERM`), or its number.
pub fn signal_name(signal: i32) -> String {
    let name = match signal {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGXFSZ => "SIGXFSZ",
        _ => return format!("signal {signal}"),
    };
    name.to_string()
}
