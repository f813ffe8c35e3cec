//! `cargo xtask ci`: installs what the tests need, then fmt, clippy, build and the whole suite.
use crate::{cross, util};
use anyhow::Result;
use std::process::Command;

/// Debian packages the tests use as real peers and oracles.
const DEBIAN_PACKAGES: &[&str] = &[
    "skopeo",
    "umoci",
    "docker-registry",
    "qemu-user-static",
    "openssl",
    "curl",
    "hyperfine",
    "faketime",
    // The coordinator's shared store: throwaway clusters made with initdb and pg_ctl.
    "postgresql",
    // The static busybox the Docker tests' images are built from (tests/src/docker.rs); the
    // engine itself (docker.io) is the machine's, as the tests use it for real.
    "busybox-static",
    // The TLS terminator in front of the engine's socket: a remote engine with mutual TLS.
    "stunnel4",
];

/// PyPI packages the tests use, as (import name, package name).
const PYTHON_PACKAGES: &[(&str, &str)] = &[("yaml", "PyYAML")];

pub fn run() -> Result<()> {
    install_debian_packages()?;
    install_python_packages()?;
    cross::install_toolchain()?;
    util::run(Command::new("cargo").args(["fmt", "--all", "--check"]))?;
    util::run(Command::new("cargo").args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]))?;
    util::run(Command::new("cargo").args(["build", "--workspace", "--bins"]))?;
    // The aarch64 supervisor and agent run under qemu-aarch64-static in the suite.
    cross::build_static(
        "aarch64-unknown-linux-musl",
        &["fleet-agent", "fleet-run-supervisor"],
    )?;
    util::run(Command::new("cargo").args(["test", "--workspace", "--", "--test-threads=4"]))?;
    Ok(())
}

fn install_debian_packages() -> Result<()> {
    let missing: Vec<&str> = DEBIAN_PACKAGES
        .iter()
        .copied()
        .filter(|p| !dpkg_installed(p))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    util::run(Command::new("apt-get").args(["update", "-qq"]))?;
    util::run(
        Command::new("apt-get")
            .args(["install", "-y", "-qq", "--no-install-recommends"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
}

fn install_python_packages() -> Result<()> {
    for (module, package) in PYTHON_PACKAGES {
        if !util::python_imports(module) {
            util::run(Command::new("python3").args(["-m", "pip", "install", "--quiet", package]))?;
        }
    }
    Ok(())
}

fn dpkg_installed(package: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", package])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
        .unwrap_or(false)
}
