//! `cargo xtask ci`: installs what the tests need, then fmt, clippy, build, the whole suite and a
//! short run of every fuzz target.
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
    // `cargo xtask bench content` times scp through a private sshd beside curl.
    "openssh-server",
    "openssh-client",
    "hyperfine",
    "faketime",
    // The coordinator's shared store: throwaway clusters made with initdb and pg_ctl.
    "postgresql",
    // The static busybox the Docker tests' images are built from (tests/src/docker.rs); the
    // engine itself (docker.io) is the machine's, as the tests use it for real.
    "busybox-static",
    // The TLS terminator in front of the engine's socket: a remote engine with mutual TLS.
    "stunnel4",
    // The simulated fresh machine in tests/it/bootstrap.rs: its root, its veth pair, the unit's
    // check, the stripped bundle, and Debian's python3 with what cloud-init's schema check imports.
    "iproute2",
    "systemd",
    "binutils",
    "python3",
    "python3-configobj",
    "python3-jinja2",
    "python3-jsonpatch",
    "python3-jsonschema",
    "python3-netifaces",
    "python3-oauthlib",
    "python3-requests",
    "python3-serial",
    "python3-yaml",
    // The metrics listener scraped by a real Prometheus, its exposition and docs/alerts.yml
    // checked by promtool (both in Debian's prometheus package).
    "prometheus",
    // The status page tested in a real browser through WebDriver.
    "chromium",
    "chromium-driver",
    // `cargo xtask ci --busy`: both cores and the disk loaded while the suite runs.
    "stress-ng",
];

/// How long CI fuzzes each target (`cargo xtask fuzz --time`): with the nightly toolchain,
/// cargo-fuzz and the instrumented build, about 10 minutes in all (docs/fuzzing.md).
const FUZZ_SECONDS_PER_TARGET: u64 = 20;

/// PyPI packages the tests use, as (import name, package name). `spdx-tools` is the SPDX
/// project's validator (`pyspdxtools`), which checks the SBOMs of `oci build --sbom`.
const PYTHON_PACKAGES: &[(&str, &str)] = &[("yaml", "PyYAML"), ("spdx_tools", "spdx-tools")];

pub fn run(busy: bool) -> Result<()> {
    install_debian_packages()?;
    install_python_packages()?;
    unpack_cloud_init()?;
    cross::install_toolchain()?;
    util::run(Command::new("cargo").args(["fmt", "--all", "--check"]))?;
    // The map's checkable claims: layers, cycles, public modules, the package order.
    crate::layers::run(false)?;
    util::run(Command::new("cargo").args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]))?;
    util::run(Command::new("cargo").args(["build", "--workspace", "--bins"]))?;
    // The aarch64 supervisor, agent and oci run under qemu-aarch64-static in the suite.
    cross::build_static(
        "aarch64-unknown-linux-musl",
        &["fleet-agent", "fleet-run-supervisor", "oci"],
    )?;
    ensure_docker_engine()?;
    let load = busy.then(Load::start).transpose()?;
    let begun = std::time::Instant::now();
    util::run(Command::new("cargo").args(["test", "--workspace", "--", "--test-threads=4"]))?;
    eprintln!(
        "the suite took {:.0} s{}",
        begun.elapsed().as_secs_f64(),
        if load.is_some() {
            " under stress-ng"
        } else {
            ""
        }
    );
    drop(load);
    // Every fuzz target from its seeds for a short fixed time (the suite above replayed the
    // seeds and kept crashes on stable): a change that breaks a decoder's promise shows here.
    // A fixed seed makes the same mutations each run, so CI judges the change, not its luck;
    // new ground is for long runs (`cargo xtask fuzz --time 600`, docs/fuzzing.md).
    crate::fuzz::run(
        FUZZ_SECONDS_PER_TARGET,
        None,
        false,
        &["-seed=1".to_string()],
    )?;
    // Bundles are byte-identical from two checkouts at different paths (two release builds).
    cross::check_reproducible(Some("x86_64"))?;
    Ok(())
}

/// The Docker tests use the machine's engine for real: where it does not answer (not started
/// yet, or gone), start `dockerd` in a session of its own and wait for it.
fn ensure_docker_engine() -> Result<()> {
    use std::os::unix::process::CommandExt as _;
    let answers = || {
        Command::new("docker")
            .args(["version", "--format", "{{.Server.APIVersion}}"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if answers() {
        return Ok(());
    }
    let log = std::fs::File::create(cross::target_dir().join("dockerd.log"))?;
    let mut cmd = Command::new("dockerd");
    cmd.stdout(log.try_clone()?)
        .stderr(log)
        .stdin(std::process::Stdio::null())
        .process_group(0);
    eprintln!("the Docker engine does not answer: $ {cmd:?} &");
    cmd.spawn().map_err(|e| {
        anyhow::anyhow!("cannot start dockerd ({e}): install docker.io or start the engine")
    })?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(90);
    while std::time::Instant::now() < deadline {
        if answers() {
            return Ok(());
        }
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
    anyhow::bail!(
        "dockerd did not answer within 90 s: see {}",
        cross::target_dir().join("dockerd.log").display()
    )
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

/// Debian's cloud-init, unpacked under target/cloud-init for its schema check (installing it
/// would set up its boot services on this machine).
fn unpack_cloud_init() -> Result<()> {
    let into = cross::target_dir().join("cloud-init");
    if into
        .join("usr/lib/python3/dist-packages/cloudinit/config/schema.py")
        .exists()
    {
        return Ok(());
    }
    let download = cross::target_dir().join("cloud-init-deb");
    std::fs::create_dir_all(&download)?;
    util::run(
        Command::new("apt-get")
            .args(["download", "cloud-init"])
            .current_dir(&download),
    )?;
    util::run(Command::new("sh").arg("-c").arg(format!(
        "dpkg -x {}/cloud-init_*.deb {}",
        download.display(),
        into.display()
    )))
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

/// stress-ng keeping both cores and the disk busy, in a process group of its own that is
/// stopped whole when this is dropped.
struct Load(std::process::Child);

impl Load {
    fn start() -> Result<Load> {
        use std::os::unix::process::CommandExt as _;
        let scratch = cross::target_dir().join("stress-ng");
        std::fs::create_dir_all(&scratch)?;
        let mut cmd = Command::new("stress-ng");
        cmd.args([
            "--cpu",
            "2",
            "--io",
            "1",
            "--hdd",
            "1",
            "--hdd-bytes",
            "256m",
        ])
        .args(["--timeout", "4h", "--temp-path"])
        .arg(&scratch)
        .stdout(std::process::Stdio::null())
        .process_group(0);
        eprintln!("$ {cmd:?} &");
        Ok(Load(cmd.spawn()?))
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        let group = -(self.0.id() as i32);
        // SAFETY: kill(2) with a process group id is a plain system call.
        unsafe { libc::kill(group, libc::SIGTERM) };
        let _ = self.0.wait();
    }
}
