//! Small helpers for the workspace tests: where the built binaries are, and running them.
pub mod agent;
pub mod docker;
pub mod oci;
pub mod pki;
pub mod postgres;
pub mod registry;
pub mod runtime_suite;
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
pub fn tempdir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("fleet-test-")
        .tempdir()
        .expect("can create a temporary directory")
}
