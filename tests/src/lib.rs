//! Small helpers for the workspace tests: where the built binaries are, and running them.
pub mod agent;
pub mod docker;
pub mod netns;
pub mod oci;
pub mod pki;
pub mod postgres;
pub mod referrers_api;
pub mod registry;
pub mod release;
pub mod runtime_suite;
pub mod sysfs;
pub mod webdriver;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The cargo target directory the tests were built into.
pub fn target_dir() -> PathBuf {
    // current_exe is target/<profile>/deps/<area>-<hash>
    let exe = std::env::current_exe().expect("the test binary knows its path");
    exe.parent()
        .and_then(Path::parent)
        .and_then(Path::parent)
        .expect("the test binary lives in target/<profile>/deps")
        .to_path_buf()
}

/// A test's run id, valid by construction.
pub fn rid(id: &str) -> fleet_proto::RunId {
    fleet_proto::RunId::parse(id).expect("a test's run id is valid")
}

/// A workspace binary built by `cargo build --workspace` (which `cargo xtask ci` runs first).
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary knows its path");
    let path = exe
        .parent()
        .and_then(Path::parent)
        .expect("the test binary lives in target/<profile>/deps")
        .join(name);
    assert!(
        path.exists(),
        "{} is missing: run `cargo build --workspace` before `cargo test` (cargo xtask ci does)",
        path.display()
    );
    path
}

/// A command for a workspace binary.
pub fn cmd(name: &str) -> Command {
    Command::new(bin(name))
}

/// Runs a command and returns its output, panicking only if it cannot start.
pub fn output(cmd: &mut Command) -> Output {
    cmd.output()
        .unwrap_or_else(|e| panic!("cannot run {:?}: {e}", cmd.get_program()))
}

/// Runs a command that must succeed; returns its stdout as a string.
pub fn ok(cmd: &mut Command) -> String {
    let out = output(cmd);
    assert!(
        out.status.success(),
        "{:?} failed with {}\nstdout: {}\nstderr: {}",
        cmd,
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("stdout is UTF-8")
}

/// Runs a command that must fail; returns its stderr as a string.
pub fn fails(cmd: &mut Command) -> String {
    let out = output(cmd);
    assert!(
        !out.status.success(),
        "{:?} succeeded but should have failed\nstdout: {}",
        cmd,
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8(out.stderr).expect("stderr is UTF-8")
}

/// A fresh temporary directory, removed when dropped.
/// A fresh folder, removed when dropped unless `FLEET_TEST_KEEP` is set (to read a failed
/// test's logs).
pub fn tempdir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("fleet-test-")
        .disable_cleanup(std::env::var_os("FLEET_TEST_KEEP").is_some())
        .tempdir()
        .expect("can create a temporary directory")
}

/// A tiny tmpfs, unmounted when dropped, so "the disk is full" is real.
pub struct TinyDisk(pub PathBuf);

impl TinyDisk {
    /// Mounts a tmpfs of `size` (as `mount -o size=` takes it: 256k, 4m) at `at`.
    pub fn mount(at: PathBuf, size: &str) -> TinyDisk {
        std::fs::create_dir_all(&at).unwrap();
        ok(Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&at));
        TinyDisk(at)
    }

    /// Gives the disk a new size, keeping what it holds.
    pub fn resize(&self, size: &str) {
        ok(Command::new("mount")
            .args(["-o", &format!("remount,size={size}")])
            .arg(&self.0));
    }

    /// Fills the disk with `filler` until a write fails for lack of space.
    pub fn fill(&self, filler: &str) {
        use std::io::Write;
        let mut file = std::fs::File::create(self.0.join(filler)).expect("can create the filler");
        let chunk = vec![0u8; 4096];
        loop {
            match file.write_all(&chunk).and_then(|()| file.sync_all()) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(28) => return,
                Err(e) => panic!("cannot fill {}: {e}", self.0.display()),
            }
        }
    }
}

impl Drop for TinyDisk {
    fn drop(&mut self) {
        // Lazily: a process of the test may still hold a file there.
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// Whether the caller is the test `name` running alone in a process of its own. Called first
/// in a test that measures its own process (its peak memory): in the harness's process, where
/// other tests run on other threads and their memory would count too, it runs this test binary
/// again with `name` alone, asserts that it passed, and returns `false`.
pub fn in_own_process(name: &str) -> bool {
    const ALONE: &str = "TESTKIT_ALONE";
    if std::env::var(ALONE).is_ok_and(|n| n == name) {
        return true;
    }
    let exe = std::env::current_exe().expect("the test binary knows its path");
    let out = output(
        Command::new(exe)
            .args([name, "--exact", "--nocapture", "--test-threads=1"])
            .env(ALONE, name),
    );
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprint!("{text}");
    assert!(
        out.status.success() && text.contains("1 passed"),
        "{name} failed in its own process ({})",
        out.status
    );
    false
}

/// A process's peak resident memory (VmHWM), in MiB.
pub fn peak_rss_mib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap();
    kib >> 10
}

/// Resets this process's peak resident memory to what it holds now (Linux 4.0 and later), so
/// [`peak_rss_mib`] measures what follows.
pub fn reset_peak_rss() {
    std::fs::write("/proc/self/clear_refs", "5").expect("can reset the peak RSS");
}
