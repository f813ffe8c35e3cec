//! Static musl builds for x86_64 and arm64 (through cargo-zigbuild), and the hub bundles.
use crate::util;
use anyhow::{Result, bail};
use std::process::Command;

pub const TARGETS: &[(&str, &str)] = &[
    ("x86_64", "x86_64-unknown-linux-musl"),
    ("arm64", "aarch64-unknown-linux-musl"),
];

/// Installs the musl targets, zig (from PyPI) and cargo-zigbuild when missing.
pub fn install_toolchain() -> Result<()> {
    let installed = Command::new("rustup")
        .args(["target", "list", "--installed"])
        .output()?;
    let installed = String::from_utf8_lossy(&installed.stdout).into_owned();
    for (_, target) in TARGETS {
        if !installed.lines().any(|l| l.trim() == *target) {
            util::run(Command::new("rustup").args(["target", "add", target]))?;
        }
    }
    if !zig_importable() {
        util::run(Command::new("python3").args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "ziglang",
        ]))?;
    }
    if !util::have("cargo-zigbuild") {
        util::run(Command::new("cargo").args(["install", "--locked", "cargo-zigbuild"]))?;
    }
    Ok(())
}

fn zig_importable() -> bool {
    Command::new("python3")
        .args(["-c", "import ziglang"])
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// Builds the named packages' binaries, release and static, for one musl target.
pub fn build_static(target: &str, packages: &[&str]) -> Result<()> {
    let mut cmd = Command::new("cargo");
    cmd.args(["zigbuild", "--release", "--target", target]);
    for p in packages {
        cmd.args(["--package", p]);
    }
    util::run(&mut cmd)
}

/// `cargo xtask dist`: static binaries for each architecture, packed as bundles.
pub fn dist(arch: Option<&str>) -> Result<()> {
    install_toolchain()?;
    let selected: Vec<_> = TARGETS
        .iter()
        .filter(|(a, _)| arch.is_none_or(|want| want == *a))
        .collect();
    if selected.is_empty() {
        bail!("unknown architecture {:?}: use x86_64 or arm64", arch.unwrap_or_default());
    }
    for (_, target) in selected {
        build_static(target, &["fleet-agent", "fleet-run-supervisor", "oci"])?;
    }
    Ok(())
}
