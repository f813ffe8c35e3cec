//! `cargo xtask image`: the agent's own multi-arch OCI image (linux/amd64 and linux/arm64), built
//! by `oci` from the static binaries (gzip layers, which every engine reads), so the same binaries
//! always give the same index digest.
use crate::{cross, util};
use anyhow::{Context, Result};
use std::process::Command;

/// The OCI platform of each bundle architecture.
const PLATFORMS: &[(&str, &str)] = &[("x86_64", "linux/amd64"), ("arm64", "linux/arm64/v8")];

pub fn run() -> Result<()> {
    cross::install_toolchain()?;
    let dist = util::root().join("dist");
    let layout = dist.join("image");
    if layout.exists() {
        std::fs::remove_dir_all(&layout)?;
    }
    let oci = build_host_oci()?;
    let mut refs = Vec::new();
    for &(arch, target) in cross::TARGETS {
        cross::build_static(target, &["fleet-agent", "fleet-run-supervisor"])?;
        let platform = PLATFORMS
            .iter()
            .find(|(a, _)| *a == arch)
            .map(|(_, p)| *p)
            .context("every target has a platform")?;
        let root = dist.join(format!("image-root-{arch}"));
        if root.exists() {
            std::fs::remove_dir_all(&root)?;
        }
        std::fs::create_dir_all(&root)?;
        for bin in cross::BUNDLE_BINARIES {
            let from = cross::target_dir().join(target).join("release").join(bin);
            std::fs::copy(&from, root.join(bin))
                .with_context(|| format!("cannot copy {}", from.display()))?;
        }
        let reference = format!("fleet-agent-{arch}");
        util::run(
            Command::new(&oci)
                .arg("build")
                .arg("--layout")
                .arg(&layout)
                .args(["--ref", &reference, "--root"])
                .arg(&root)
                .args(["--platform", platform, "--prefix", "/usr/local/bin"])
                .args(["--entrypoint", "/usr/local/bin/fleet-agent"])
                .args(["--cmd", "--head-less", "--compression", "gzip"])
                .args(["--label", "org.opencontainers.image.title=fleet-agent"]),
        )?;
        std::fs::remove_dir_all(&root)?;
        refs.push(reference);
    }
    let mut index = Command::new(&oci);
    index
        .arg("index")
        .arg("--layout")
        .arg(&layout)
        .args(["--ref", "fleet-agent"]);
    for r in &refs {
        index.args(["--manifest", r]);
    }
    util::run(&mut index)?;
    eprintln!(
        "the multi-arch image is oci:{}:fleet-agent",
        layout.display()
    );
    Ok(())
}

/// Builds `oci` for this machine and returns its path.
fn build_host_oci() -> Result<std::path::PathBuf> {
    util::run(Command::new("cargo").args(["build", "--quiet", "--release", "-p", "oci"]))?;
    Ok(cross::target_dir().join("release/oci"))
}
