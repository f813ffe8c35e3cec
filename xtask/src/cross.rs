//! Static musl builds for x86_64 and arm64 (through cargo-zigbuild), and the hub bundles.
use crate::util;
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
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
    if !util::python_imports("ziglang") {
        util::run(Command::new("python3").args(["-m", "pip", "install", "--quiet", "ziglang"]))?;
    }
    if !util::have("cargo-zigbuild") {
        util::run(Command::new("cargo").args(["install", "--locked", "cargo-zigbuild"]))?;
    }
    Ok(())
}

/// Builds the named packages' binaries, release and static, for one musl target, with the
/// checkout's and cargo's folders remapped out of them (the same binaries from any path).
pub fn build_static(target: &str, packages: &[&str]) -> Result<()> {
    install_toolchain()?;
    let mut cmd = Command::new("cargo");
    cmd.args(["zigbuild", "--release", "--target", target])
        .env("CARGO_ENCODED_RUSTFLAGS", reproducible_rustflags())
        .env_remove("RUSTFLAGS");
    if target.starts_with("aarch64") {
        // The coordinator's jemalloc learns the page size when it is built, and refuses a kernel
        // whose pages are larger: 64 KiB pages serve arm64 kernels of 4, 16 and 64 KiB alike.
        cmd.env("JEMALLOC_SYS_WITH_LG_PAGE", "16");
    }
    for p in packages {
        cmd.args(["--package", p]);
    }
    util::run(&mut cmd)
}

/// `--remap-path-prefix` for the checkout, the target folder and cargo's home, as
/// CARGO_ENCODED_RUSTFLAGS (0x1f between flags, so a path may hold spaces). The profile strips
/// debug info; these cover the paths that remain (panic locations of dependencies).
fn reproducible_rustflags() -> String {
    let mut remaps = vec![(util::root(), "/build"), (target_dir(), "/target")];
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")));
    if let Some(home) = cargo_home {
        remaps.push((home, "/cargo"));
    }
    remaps
        .iter()
        .map(|(from, to)| format!("--remap-path-prefix={}={to}", from.display()))
        .collect::<Vec<_>>()
        .join("\x1f")
}

/// The binaries a machine runs, packed into each bundle.
pub const BUNDLE_BINARIES: &[&str] = &["fleet-agent", "fleet-run-supervisor"];

/// `cargo xtask dist`: static binaries for each architecture, packed as reproducible
/// `dist/hub-linux-<arch>.tar.gz` bundles with a `SHA256SUMS` beside them.
pub fn dist(arch: Option<&str>) -> Result<()> {
    install_toolchain()?;
    let selected: Vec<_> = TARGETS
        .iter()
        .filter(|(a, _)| arch.is_none_or(|want| want == *a))
        .collect();
    if selected.is_empty() {
        bail!(
            "unknown architecture {:?}: use x86_64 or arm64",
            arch.unwrap_or_default()
        );
    }
    let dist = util::root().join("dist");
    std::fs::create_dir_all(&dist)?;
    eprintln!("xtask: building bundles into {}", dist.display());
    for (arch, target) in selected {
        build_static(
            target,
            &[
                "fleet-agent",
                "fleet-coordinator",
                "fleet-run-supervisor",
                "oci",
            ],
        )?;
        pack_bundle(arch, target, &dist)?;
    }
    util::run(
        Command::new("sh")
            .arg("-c")
            .arg("sha256sum hub-linux-*.tar.gz > SHA256SUMS && cat SHA256SUMS")
            .current_dir(&dist),
    )
}

/// Signs the release in `dist/` with the release key `key` (its certificate `KEY.cert`), through
/// `fleet-coordinator release sign`, which writes `release.json` and `release.sig`.
pub fn sign(key: &Path, sequence: Option<u64>) -> Result<()> {
    let sequence = match sequence {
        Some(n) => n,
        None => {
            let out = util::output(Command::new("git").args(["rev-list", "--count", "HEAD"]))?;
            out.trim()
                .parse()
                .with_context(|| format!("git rev-list --count HEAD printed {out:?}"))?
        }
    };
    let mut cert = key.as_os_str().to_owned();
    cert.push(".cert");
    util::run(
        Command::new(env!("CARGO"))
            .args([
                "run",
                "-q",
                "-p",
                "fleet-coordinator",
                "--",
                "release",
                "sign",
                "--key",
            ])
            .arg(key)
            .arg("--cert")
            .arg(&cert)
            .arg("--dir")
            .arg(util::root().join("dist"))
            .arg("--sequence")
            .arg(sequence.to_string())
            .current_dir(util::root()),
    )
}

/// Packs one bundle with fixed owners, modes, times and order, and gzip at a fixed level without
/// name or time, so the same binaries give the same bytes.
fn pack_bundle(arch: &str, target: &str, dist: &Path) -> Result<()> {
    let release = target_dir().join(target).join("release");
    let staging = dist.join(format!("hub-linux-{arch}"));
    if staging.exists() {
        std::fs::remove_dir_all(&staging)?;
    }
    std::fs::create_dir_all(&staging)?;
    for bin in BUNDLE_BINARIES {
        let from = release.join(bin);
        std::fs::copy(&from, staging.join(bin))
            .with_context(|| format!("cannot copy {}", from.display()))?;
    }
    let bundle = dist.join(format!("hub-linux-{arch}.tar.gz"));
    let script = format!(
        "tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 --mode=u=rwX,go=rX \
         --format=posix --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
         -C {staging} -cf - . | gzip -9 -n > {bundle}.tmp && mv {bundle}.tmp {bundle}",
        staging = staging.display(),
        bundle = bundle.display()
    );
    util::run(Command::new("sh").arg("-c").arg(script))?;
    std::fs::remove_dir_all(&staging)?;
    Ok(())
}

/// Cargo's target directory, honouring CARGO_TARGET_DIR.
pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| util::root().join("target"))
}

/// `cargo xtask dist-check`: `cargo xtask dist` from two fresh clones of this checkout's HEAD at
/// different paths, sharing one target folder (so a wrong checkout path would show), and their
/// bundles and SHA256SUMS compared byte for byte.
pub fn check_reproducible(arch: Option<&str>) -> Result<()> {
    let base = target_dir().join("dist-check");
    if base.exists() {
        std::fs::remove_dir_all(&base)?;
    }
    let clones = [base.join("a/checkout"), base.join("b/another-checkout")];
    for clone in &clones {
        std::fs::create_dir_all(clone.parent().expect("a clone has a parent"))?;
        util::run(
            Command::new("git")
                .args(["clone", "--quiet", "--no-local"])
                .arg(util::root())
                .arg(clone),
        )?;
        let mut dist = Command::new("cargo");
        dist.args(["xtask", "dist"])
            .current_dir(clone)
            .env("CARGO_TARGET_DIR", target_dir())
            .env_remove("CARGO_MANIFEST_DIR");
        if let Some(arch) = arch {
            dist.args(["--arch", arch]);
        }
        util::run(&mut dist)?;
    }
    let (a, b) = (clones[0].join("dist"), clones[1].join("dist"));
    let mut names: Vec<String> = std::fs::read_dir(&a)?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".tar.gz") || n == "SHA256SUMS")
        .collect();
    names.sort();
    if names.is_empty() {
        bail!(
            "{} holds no bundles: cargo xtask dist wrote them elsewhere",
            a.display()
        );
    }
    for name in &names {
        let (left, right) = (std::fs::read(a.join(name))?, std::fs::read(b.join(name)));
        let right = right.with_context(|| format!("{} lacks {name}", b.display()))?;
        if left != right {
            bail!(
                "{name} differs between {} and {}: the bundles are not reproducible; compare the unpacked binaries with diffoscope",
                a.display(),
                b.display()
            );
        }
        eprintln!("xtask: {name} is byte-identical from both checkouts");
    }
    std::fs::remove_dir_all(&base)?;
    Ok(())
}
