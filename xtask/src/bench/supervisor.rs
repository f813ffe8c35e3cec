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
/// The supervisor's default `--keep`.
const KEEP: usize = 1000;

pub fn run() -> Result<()> {
    cross::build_static(TARGET, &["fleet-run-supervisor"])?;
    let binary = cross::target_dir()
        .join(TARGET)
        .join("release")
        .join("fleet-run-supervisor");
    let size = std::fs::metadata(&binary)
        .with_context(|| format!("cannot read {}", binary.display()))?
        .len();
    // On the disk the store lives on in production (/var/lib), not a memory filesystem. An
    // earlier run's stores are moved aside now and deleted only after measuring: on ext4
    // without a journal, inodes freed in the last 30 s slow every file creation down.
    let base = cross::target_dir().join("bench-supervisor");
    let trash = base.join(format!("trash-{}", std::process::id()));
    std::fs::create_dir_all(&trash)?;
    for old in std::fs::read_dir(&base)?.flatten() {
        if old.path() != trash {
            std::fs::rename(old.path(), trash.join(old.file_name()))?;
        }
    }
    let shm = Path::new("/dev/shm").join(format!("bench-supervisor-{}", std::process::id()));
    let stores = [
        Store::new(&binary, base.join("fresh"), None)?,
        Store::new(&binary, base.join("fresh-pg"), Some("--no-cgroup"))?,
        Store::new(&binary, base.join("full"), None)?,
        // Where fsync and inode allocation cost next to nothing: the supervisor's own share.
        Store::new(&binary, shm.clone(), None)?,
    ];
    // The store at its retention limit (the default --keep), so each finish removes the oldest.
    for i in 0..KEEP {
        stores[2].start_and_wait(&format!("fill-{i}"))?;
    }

    let (mut direct, mut timeout) = (vec![], vec![]);
    let mut samples: Vec<Vec<f64>> = vec![vec![]; stores.len()];
    let (mut fsyncs, mut creates) = (vec![], vec![]);
    for i in 0..ITERATIONS {
        direct.push(measure(&mut Command::new("/bin/true"))?.seconds);
        timeout.push(measure(Command::new("timeout").args(["10", "/bin/true"]))?.seconds);
        for (store, samples) in stores.iter().zip(&mut samples) {
            samples.push(store.start_and_wait(&format!("run-{i}"))?);
        }
        let probe = disk_probe(&base.join("fresh"), i)?;
        creates.push(probe.create);
        fsyncs.push(probe.fsync);
    }
    let containment = result_field(&base.join("fresh"), "run-0", "containment")?;
    let peak = supervising_peak_kib(&binary, &base.join("fresh"), &stores[0].stage("/bin/sh")?)?;
    let _ = std::fs::remove_dir_all(&shm);
    let _ = std::fs::remove_dir_all(&trash);

    let ms = |v: &[f64]| median(v) * 1e3;
    let p10 = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 10] * 1e3
    };
    let d = ms(&direct);
    let row = |name: &str, v: &[f64], over: bool| {
        let over = if over {
            format!("{:+.2} ms", ms(v) - d)
        } else {
            String::new()
        };
        format!("| {name} | {:.2} ms | {over} | {:.2} ms |\n", ms(v), p10(v))
    };
    let rows = [
        row("`/bin/true`", &direct, false),
        row("`timeout 10 /bin/true`", &timeout, true),
        row(&format!("`start`+`wait`, containment `{containment}`"), &samples[0], true),
        row("`start`+`wait --no-cgroup` (process group + subreaper)", &samples[1], true),
        row(&format!("`start`+`wait`, store at its retention limit ({KEEP} finished runs, each finish removes the oldest)"), &samples[2], true),
        row("`start`+`wait`, store on tmpfs (`/dev/shm`: fsync and inode allocation are nearly free)", &samples[3], true),
        row("the store's disk: creating one empty file", &creates, false),
        row("the store's disk: one small file write + fsync of its folder", &fsyncs, false),
    ]
    .concat();
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let load = load.split_whitespace().next().unwrap_or("?");
    let markdown = format!(
        "## supervisor\n\n\
         `start` then `wait` of `/bin/true` (the run's durable `result.json` included) against\n\
         `/bin/true` run directly and under coreutils `timeout`; {ITERATIONS} iterations each,\n\
         interleaved. Store on the root filesystem, {fs}; static musl release binary, \
         {cores} cores, load average {load} when it ended.\n\n\
         | command | median | median overhead over `/bin/true` | p10 |\n\
         |---|---|---|---|\n\
         {rows}\n\
         | figure | value | target |\n\
         |---|---|---|\n\
         | supervisor peak RSS while supervising 100 MiB of output under a 1 MiB limit | {peak} KiB | <= 2048 KiB |\n\
         | stripped static binary (`{TARGET}`) | {size} bytes ({:.0} KiB) | <= 1024 KiB |\n\n\
         The overhead target is <= 2 ms. On a disk, a run pays for two things a memory\n\
         filesystem makes nearly free: three fsyncs (the claim of its id before the program runs,\n\
         then `result.json` and its folder) and five new inodes (the run folder, `stdout`,\n\
         `stderr`, `supervisor.json`, the result's temporary file); the last two rows give the\n\
         disk's price for each in the same run. On ext4 without a journal a new inode costs\n\
         more for up to 6 minutes after many were freed (the allocator skips them): this\n\
         benchmark deletes an earlier run's stores only after measuring, yet a run started\n\
         soon after another (or after other deletions) still pays for them, as the creation\n\
         row then shows. `start`+`wait` hands off between four processes\n\
         (start, supervisor, program, wait), so on a machine busy with other work each hop can\n\
         wait for a CPU; the p10 column shows the cost when it does not.\n\n\
         Reproduce: `cargo xtask bench supervisor`\n",
        size as f64 / 1024.0,
        fs = filesystem_of(&base),
        cores = std::thread::available_parallelism().map_or(0, |n| n.get()),
    );
    record_benchmark("supervisor", &markdown)?;
    println!("{markdown}");
    if size > SIZE_LIMIT {
        bail!("the supervisor binary is {size} bytes, over the 1 MiB target");
    }
    Ok(())
}

/// One run store the benchmark drives, with `/bin/true` staged in it.
struct Store<'a> {
    binary: &'a Path,
    root: PathBuf,
    extra: Option<&'static str>,
    program: String,
}

impl<'a> Store<'a> {
    fn new(binary: &'a Path, root: PathBuf, extra: Option<&'static str>) -> Result<Self> {
        let mut store = Store {
            binary,
            root,
            extra,
            program: String::new(),
        };
        store.program = store.stage("/bin/true")?;
        Ok(store)
    }

    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(self.binary);
        c.arg("--root")
            .arg(&self.root)
            .args(args)
            .stdout(Stdio::null());
        c
    }

    fn stage(&self, file: &str) -> Result<String> {
        let out = self.cmd(&["stage", file]).stdout(Stdio::piped()).output()?;
        if !out.status.success() {
            bail!(
                "stage {file} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8(out.stdout)?.trim().to_string())
    }

    /// Seconds for `start` then `wait` of the staged `/bin/true` as run `id`.
    fn start_and_wait(&self, id: &str) -> Result<f64> {
        let mut args = vec!["start", "--run", id, "--program", &self.program];
        args.extend(self.extra);
        let started = measure(&mut self.cmd(&args))?;
        let waited = measure(&mut self.cmd(&["wait", "--run", id]))?;
        Ok(started.seconds + waited.seconds)
    }
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

struct DiskProbe {
    create: f64,
    fsync: f64,
}

/// What the store's disk charges for one new file, and for a small write made durable the
/// way a run's record is; the probes are left in place (see the trash above).
fn disk_probe(root: &Path, i: usize) -> Result<DiskProbe> {
    let dir = root.join("tmp");
    let begun = Instant::now();
    std::fs::File::create(dir.join(format!("create-probe-{i}")))?;
    let create = begun.elapsed().as_secs_f64();
    let begun = Instant::now();
    std::fs::write(dir.join(format!("fsync-probe-{i}")), b"x")?;
    std::fs::File::open(&dir)?.sync_all()?;
    Ok(DiskProbe {
        create,
        fsync: begun.elapsed().as_secs_f64(),
    })
}

fn result_field(root: &Path, run: &str, field: &str) -> Result<String> {
    let path: PathBuf = root.join("runs").join(run).join("result.json");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path)?)?;
    Ok(v[field].as_str().unwrap_or("?").to_string())
}

/// The filesystem type and options of the mount holding `path`, from /proc/self/mounts (the
/// longest mount point that prefixes it), e.g. `ext4 (rw,relatime)`.
fn filesystem_of(path: &Path) -> String {
    let path = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    mounts
        .lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let journal = match (f.get(2), f[0].strip_prefix("/dev/")) {
                // ext4 names its journal thread here, or `<none>` when it runs without one.
                (Some(&"ext4"), Some(dev)) => std::fs::read_to_string(format!(
                    "/sys/fs/ext4/{dev}/journal_task"
                ))
                .map_or(String::new(), |t| {
                    if t.trim() == "<none>" {
                        ", no journal".to_string()
                    } else {
                        String::new()
                    }
                }),
                _ => String::new(),
            };
            (f.len() >= 4 && path.starts_with(f[1]))
                .then(|| (f[1].len(), format!("`{}` ({}{journal})", f[2], f[3])))
        })
        .max_by_key(|(len, _)| *len)
        .map_or_else(|| "?".to_string(), |(_, fs)| fs)
}
