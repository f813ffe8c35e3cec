//! `cargo xtask bench supervisor`: `fleet-run-supervisor start`+`wait` of `/bin/true` against
//! `/bin/true` run directly and `timeout 10 /bin/true`, the supervisor's peak memory while it
//! supervises, and the stripped static binary's size.
use crate::cross;
use crate::util::{self, measure, median, record_benchmark};
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const ITERATIONS: usize = 200;
const TARGET: &str = "x86_64-unknown-linux-musl";
const SIZE_LIMIT: u64 = 1024 * 1024;

pub fn run() -> Result<()> {
    cross::build_static(TARGET, &["fleet-run-supervisor"])?;
    let binary = cross::target_dir()
        .join(TARGET)
        .join("release")
        .join("fleet-run-supervisor");
    let size = std::fs::metadata(&binary)
        .with_context(|| format!("cannot read {}", binary.display()))?
        .len();
    // On the disk the store lives on in production (/var/lib), not a memory filesystem.
    let root = cross::target_dir().join("bench-supervisor");
    let _ = std::fs::remove_dir_all(&root);
    let sup = |args: &[&str]| {
        let mut c = Command::new(&binary);
        c.arg("--root").arg(&root).args(args).stdout(Stdio::null());
        c
    };
    let stage = |file: &str| -> Result<String> {
        let out = Command::new(&binary)
            .arg("--root")
            .arg(&root)
            .args(["stage", file])
            .output()?;
        if !out.status.success() {
            bail!(
                "stage {file} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8(out.stdout)?.trim().to_string())
    };
    let truth = stage("/bin/true")?;

    // The same on a memory filesystem, where fsync costs nothing: the supervisor's own share.
    let shm = Path::new("/dev/shm").join(format!("bench-supervisor-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&shm);
    let shm_sup = |args: &[&str]| {
        let mut c = Command::new(&binary);
        c.arg("--root").arg(&shm).args(args).stdout(Stdio::null());
        c
    };
    util::run(
        Command::new(&binary)
            .arg("--root")
            .arg(&shm)
            .args(["stage", "/bin/true"])
            .stdout(Stdio::null()),
    )?;

    let (mut direct, mut timeout, mut cgroup, mut group, mut memory) =
        (vec![], vec![], vec![], vec![], vec![]);
    let mut fsyncs = Vec::new();
    for i in 0..ITERATIONS {
        direct.push(measure(&mut Command::new("/bin/true"))?.seconds);
        timeout.push(measure(Command::new("timeout").args(["10", "/bin/true"]))?.seconds);
        for (samples, id, extra, on_disk) in [
            (&mut cgroup, format!("cg-{i}"), None, true),
            (&mut group, format!("pg-{i}"), Some("--no-cgroup"), true),
            (&mut memory, format!("shm-{i}"), None, false),
        ] {
            let mut args = vec!["start", "--run", &id, "--program", &truth];
            args.extend(extra);
            let pick = |a: &[&str]| if on_disk { sup(a) } else { shm_sup(a) };
            let started = measure(&mut pick(&args))?;
            let waited = measure(&mut pick(&["wait", "--run", &id]))?;
            samples.push(started.seconds + waited.seconds);
        }
        fsyncs.push(dir_fsync_seconds(&root, i)?);
    }
    let _ = std::fs::remove_dir_all(&shm);
    let containment = result_field(&root, "cg-0", "containment")?;
    let peak = supervising_peak_kib(&binary, &root, &stage("/bin/sh")?)?;

    let ms = |v: &[f64]| median(v) * 1e3;
    let p10 = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 10] * 1e3
    };
    let d = ms(&direct);
    let f = ms(&fsyncs);
    let row = |name: &str, v: &[f64]| {
        let over = if name == "`/bin/true`" {
            String::new()
        } else {
            format!("{:+.2} ms", ms(v) - d)
        };
        format!("| {name} | {:.2} ms | {over} | {:.2} ms |\n", ms(v), p10(v))
    };
    let rows = [
        row("`/bin/true`", &direct),
        row("`timeout 10 /bin/true`", &timeout),
        row(&format!("`start`+`wait`, containment `{containment}`"), &cgroup),
        row("`start`+`wait --no-cgroup` (process group + subreaper)", &group),
        row("`start`+`wait`, store on tmpfs (`/dev/shm`, fsync is free)", &memory),
        format!("| one small file write + fsync of its folder on the store's disk | {f:.2} ms | | {:.2} ms |\n", p10(&fsyncs)),
    ]
    .concat();
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let load = load.split_whitespace().next().unwrap_or("?");
    let markdown = format!(
        "## supervisor\n\n\
         `start` then `wait` of `/bin/true` (the run's durable `result.json` included) against\n\
         `/bin/true` run directly and under coreutils `timeout`; {ITERATIONS} iterations each,\n\
         interleaved. Store on the root filesystem (`{fs}`), static musl release binary, \
         {cores} cores, load average {load} when it ended.\n\n\
         | command | median | median overhead over `/bin/true` | p10 |\n\
         |---|---|---|---|\n\
         {rows}\n\
         | figure | value | target |\n\
         |---|---|---|\n\
         | supervisor peak RSS while supervising 100 MiB of output under a 1 MiB limit | {peak} KiB | <= 2048 KiB |\n\
         | stripped static binary (`{TARGET}`) | {size} bytes ({:.0} KiB) | <= 1024 KiB |\n\n\
         The overhead target is <= 2 ms. A run makes three fsyncs on the store's disk (the\n\
         claim of its id before the program runs, then `result.json` and its folder), so on a\n\
         disk part of the figure is the disk's flush latency (the fsync row); the tmpfs row is\n\
         the supervisor's own cost. `start`+`wait` hands off between four processes (start,\n\
         supervisor, program, wait), so on a machine busy with other work each hop can wait\n\
         for a CPU; the p10 column shows the cost when it does not.\n\n\
         Reproduce: `cargo xtask bench supervisor`\n",
        size as f64 / 1024.0,
        fs = filesystem_of(&root),
        cores = std::thread::available_parallelism().map_or(0, |n| n.get()),
    );
    record_benchmark("supervisor", &markdown)?;
    println!("{markdown}");
    if size > SIZE_LIMIT {
        bail!("the supervisor binary is {size} bytes, over the 1 MiB target");
    }
    Ok(())
}

/// The supervisor's VmHWM, sampled until it exits, while its program floods stdout.
fn supervising_peak_kib(binary: &Path, root: &Path, shell: &str) -> Result<u64> {
    let sup = || {
        let mut c = Command::new(binary);
        c.arg("--root").arg(root);
        c
    };
    util::run(sup().args([
        "start",
        "--run",
        "peak",
        "--program",
        shell,
        "--output-limit",
        "1048576",
        "--",
        "-c",
        "head -c 104857600 /dev/zero; sleep 0.5",
    ]))?;
    let status = sup().args(["status", "--run", "peak", "--json"]).output()?;
    let v: serde_json::Value = serde_json::from_slice(&status.stdout)?;
    let Some(pid) = v["owner"]["pid"].as_u64() else {
        bail!("the peak run has no live supervisor: {v}");
    };
    let mut peak = 0;
    let begun = Instant::now();
    while let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/status")) {
        if let Some(kib) = text
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        {
            peak = peak.max(kib);
        }
        if begun.elapsed() > Duration::from_secs(60) {
            bail!("the peak run did not end within a minute");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    util::run(sup().args(["wait", "--run", "peak"]).stdout(Stdio::null()))?;
    Ok(peak)
}

/// How long one small file write plus an fsync of its folder takes on the store's disk.
fn dir_fsync_seconds(root: &Path, i: usize) -> Result<f64> {
    let dir = root.join("tmp");
    let file = dir.join(format!("fsync-probe-{i}"));
    let begun = Instant::now();
    std::fs::write(&file, b"x")?;
    std::fs::File::open(&dir)?.sync_all()?;
    let seconds = begun.elapsed().as_secs_f64();
    std::fs::remove_file(&file)?;
    Ok(seconds)
}

fn result_field(root: &Path, run: &str, field: &str) -> Result<String> {
    let path: PathBuf = root.join("runs").join(run).join("result.json");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path)?)?;
    Ok(v[field].as_str().unwrap_or("?").to_string())
}

fn filesystem_of(path: &Path) -> String {
    Command::new("stat")
        .args(["-f", "-c", "%T"])
        .arg(path)
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "?".to_string())
}
