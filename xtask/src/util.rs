//! Small helpers shared by every task: the workspace root and running commands loudly.
use anyhow::{Context, Result, bail};
use std::path::PathBuf;
use std::process::Command;

/// The workspace root of the checkout `cargo xtask` runs in, found at run time: the folder
/// above the `CARGO_MANIFEST_DIR` cargo sets for `cargo run`, else the nearest folder above the
/// current one holding `xtask/Cargo.toml`. Never the path xtask was compiled in: with one
/// CARGO_TARGET_DIR shared by two checkouts, that would be the other checkout.
pub fn root() -> PathBuf {
    static ROOT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    ROOT.get_or_init(|| {
        let is_root = |dir: &std::path::Path| dir.join("xtask/Cargo.toml").is_file();
        let from_cargo = std::env::var_os("CARGO_MANIFEST_DIR")
            .map(PathBuf::from)
            .and_then(|manifest| manifest.parent().map(PathBuf::from))
            .filter(|dir| is_root(dir));
        from_cargo
            .or_else(|| {
                let cwd = std::env::current_dir().ok()?;
                cwd.ancestors().find(|dir| is_root(dir)).map(PathBuf::from)
            })
            .unwrap_or_else(|| {
                eprintln!(
                    "xtask: cannot find the checkout: run `cargo xtask` inside it (no xtask/Cargo.toml above {})",
                    std::env::current_dir().unwrap_or_default().display()
                );
                std::process::exit(1)
            })
    })
    .clone()
}

/// Runs a command (in the workspace root unless it names a folder), echoing it, and fails on a
/// non-zero exit.
pub fn run(cmd: &mut Command) -> Result<()> {
    if cmd.get_current_dir().is_none() {
        cmd.current_dir(root());
    }
    eprintln!("$ {}", describe(cmd));
    let status = cmd
        .status()
        .with_context(|| format!("cannot start {}", describe(cmd)))?;
    if !status.success() {
        bail!("{} failed with {status}", describe(cmd));
    }
    Ok(())
}

/// Runs a command in the workspace root and answers what it printed on stdout; fails on a
/// non-zero exit.
pub fn output(cmd: &mut Command) -> Result<String> {
    let out = cmd
        .current_dir(root())
        .output()
        .with_context(|| format!("cannot start {}", describe(cmd)))?;
    if !out.status.success() {
        bail!(
            "{} failed with {}: {}",
            describe(cmd),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Whether a program is on PATH.
pub fn have(program: &str) -> bool {
    Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {program} >/dev/null 2>&1"))
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// Whether python3 can import a module (a PyPI package the project uses).
pub fn python_imports(module: &str) -> bool {
    Command::new("python3")
        .args(["-c", &format!("import {module}")])
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

fn describe(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for arg in cmd.get_args() {
        s.push(' ');
        s.push_str(&arg.to_string_lossy());
    }
    s
}

/// What one timed run of a command cost.
#[derive(Debug, Clone, Copy)]
pub struct Measured {
    pub seconds: f64,
    /// Peak resident memory of the command's largest process, in KiB (from wait4's rusage).
    pub max_rss_kib: u64,
}

/// Runs a command to completion, timing it and reading its peak memory; fails on a non-zero exit.
pub fn measure(cmd: &mut Command) -> Result<Measured> {
    use std::os::unix::process::ExitStatusExt;
    let start = std::time::Instant::now();
    let child = cmd
        .spawn()
        .with_context(|| format!("cannot start {}", describe(cmd)))?;
    let pid = child.id() as libc::pid_t;
    let mut status = 0;
    // SAFETY: rusage is plain data, zeroed is a valid value; wait4 fills it for our own child.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    let seconds = start.elapsed().as_secs_f64();
    if rc != pid {
        bail!("wait4 failed for {}", describe(cmd));
    }
    let status = std::process::ExitStatus::from_raw(status);
    if !status.success() {
        bail!("{} failed with {status}", describe(cmd));
    }
    Ok(Measured {
        seconds,
        max_rss_kib: usage.ru_maxrss as u64,
    })
}

/// The median of some samples (they need not be sorted).
pub fn median(samples: &[f64]) -> f64 {
    let mut v = samples.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Replaces (or appends) one benchmark's section of BENCHMARKS.md, leaving the others alone.
pub fn record_benchmark(name: &str, markdown: &str) -> Result<()> {
    let path = root().join("BENCHMARKS.md");
    let old = std::fs::read_to_string(&path).unwrap_or_else(|_| "# Benchmarks\n".to_string());
    let begin = format!("<!-- bench:{name} -->");
    let end = format!("<!-- /bench:{name} -->");
    let section = format!("{begin}\n{}\n{end}", markdown.trim_end());
    let new = match (old.find(&begin), old.find(&end)) {
        (Some(b), Some(e)) if e > b => format!("{}{section}{}", &old[..b], &old[e + end.len()..]),
        _ => format!("{}\n{section}\n", old.trim_end()),
    };
    let tmp = path.with_extension("md.tmp");
    std::fs::write(&tmp, new)?;
    std::fs::rename(&tmp, &path)?;
    eprintln!("recorded the {name} benchmark in {}", path.display());
    Ok(())
}

/// A `KiB` field of `/proc/PID/status` (`VmRSS`, `VmHWM`).
pub fn proc_status_kib(pid: u32, field: &str) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("no {field} in /proc/{pid}/status"))
}
