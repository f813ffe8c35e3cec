//! `cargo xtask bench build`: `oci build` (none, gzip, zstd) against `umoci insert` and the floor `tar --sort=name | sha256sum`.
use crate::util::{self, Measured, measure, median, record_benchmark, root};
use anyhow::{Context, Result};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

const RUNS: usize = 5;
const FILES: usize = 4000;

/// A small deterministic generator (xorshift64*), so every run benches the same tree.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// About 300 MiB in 4 000 files: mostly small, some medium, a few large; each file half
/// pseudo-random, half repetitive text, so compression has work of both kinds. Files are written
/// in small pieces so this process stays small (its size is the floor of the peak-memory figures).
fn generate(dir: &Path) -> Result<u64> {
    use std::io::Write;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut total = 0;
    for i in 0..FILES {
        let size = match i % 100 {
            0 => 4 << 20,
            1..=9 => 256 << 10,
            _ => (rng.next() % (28 << 10)) as usize + 512,
        };
        let path = dir.join(format!("d{:02}/s{:02}/f{i:04}.bin", i % 37, i % 11));
        fs::create_dir_all(path.parent().expect("has a parent"))?;
        let mut file = std::io::BufWriter::new(fs::File::create(&path)?);
        let mut written = 0;
        while written + 8 <= size / 2 {
            file.write_all(&rng.next().to_le_bytes())?;
            written += 8;
        }
        let line = format!("line {i} of a file that compresses well, with some words repeated\n");
        while written < size {
            let n = line.len().min(size - written);
            file.write_all(&line.as_bytes()[..n])?;
            written += n;
        }
        file.flush()?;
        total += size as u64;
    }
    Ok(total)
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target"))
}

/// One benchmarked command: a setup run before each timing (not timed), and the command.
struct Case<'a> {
    name: String,
    setup: Box<dyn Fn() -> Result<()> + 'a>,
    cmd: Box<dyn Fn() -> Command + 'a>,
}

/// Runs every case once per round, RUNS rounds, so a busy machine slows them all alike; returns
/// each case's median seconds and largest peak RSS (KiB).
fn bench(cases: &[Case]) -> Result<Vec<(f64, u64)>> {
    let mut samples = vec![Vec::new(); cases.len()];
    let mut rss = vec![0; cases.len()];
    for _ in 0..RUNS {
        for (i, case) in cases.iter().enumerate() {
            (case.setup)()?;
            let Measured {
                seconds,
                max_rss_kib,
            } = measure(&mut (case.cmd)())
                .with_context(|| format!("benchmark {}", case.name.replace('`', "")))?;
            samples[i].push(seconds);
            rss[i] = rss[i].max(max_rss_kib);
        }
    }
    Ok(samples
        .iter()
        .zip(rss)
        .map(|(s, r)| (median(s), r))
        .collect())
}

pub fn run() -> Result<()> {
    util::run(Command::new("cargo").args(["build", "--release", "-p", "oci"]))?;
    let oci = target_dir().join("release/oci");
    let work = target_dir().join("bench-build");
    let _ = fs::remove_dir_all(&work);
    let tree = work.join("tree");
    let bytes = generate(&tree)?;
    let layout = work.join("layout");
    let clear = || -> Result<()> {
        let _ = fs::remove_dir_all(&layout);
        Ok(())
    };
    let floor_cmd = || {
        let mut c = Command::new("sh");
        c.arg("-c")
            .arg("tar --sort=name -cf - . | sha256sum >/dev/null")
            .current_dir(&tree);
        c
    };
    // Warm the page cache so the first timed run reads what the others read.
    measure(&mut floor_cmd())?;
    let umoci_setup = || -> Result<()> {
        clear()?;
        let quiet = |c: &mut Command| c.stdout(std::process::Stdio::null()).status();
        quiet(
            Command::new("umoci")
                .args(["init", "--layout"])
                .arg(&layout),
        )?;
        quiet(
            Command::new("umoci")
                .arg("new")
                .arg("--image")
                .arg(format!("{}:bench", layout.display())),
        )?;
        Ok(())
    };
    let mut cases = vec![Case {
        name: "`tar --sort=name -cf - . \\| sha256sum` (floor)".to_string(),
        setup: Box::new(|| Ok(())),
        cmd: Box::new(floor_cmd),
    }];
    for compression in ["none", "gzip", "zstd"] {
        let (oci, layout, tree) = (&oci, &layout, &tree);
        cases.push(Case {
            name: format!("`oci build --compression {compression}`"),
            setup: Box::new(clear),
            cmd: Box::new(move || {
                let mut c = Command::new(oci);
                c.args(["build", "--ref", "bench", "--compression", compression]);
                c.arg("--layout")
                    .arg(layout)
                    .arg("--root")
                    .arg(tree)
                    .stdout(std::process::Stdio::null());
                c
            }),
        });
    }
    cases.push(Case {
        name: "`umoci insert` (gzip, parallel)".to_string(),
        setup: Box::new(umoci_setup),
        cmd: Box::new(|| {
            let mut c = Command::new("umoci");
            c.arg("insert")
                .arg("--image")
                .arg(format!("{}:bench", layout.display()))
                .arg(&tree)
                .arg("/");
            c.stdout(std::process::Stdio::null());
            c
        }),
    });
    let results = bench(&cases)?;
    let rows: Vec<(String, (f64, u64))> =
        cases.iter().map(|c| c.name.clone()).zip(results).collect();
    let floor = rows[0].1.0;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut md = format!(
        "## build\n\n`oci build` of a generated tree ({FILES} files, {:.0} MiB, half pseudo-random and half repetitive \
         text per file) into a fresh layout, against `umoci insert` of the same tree into a fresh `umoci init`/`umoci new` \
         layout and the floor `tar --sort=name -cf - . | sha256sum`. Median of {RUNS} rounds, each running every command once, page cache warm, \
         {cores} cores. Peak memory is the largest process's max RSS.\n\n\
         Reproduce: `cargo xtask bench build`\n\n\
         | command | median | × floor | peak memory |\n|---|---|---|---|\n",
        bytes as f64 / (1 << 20) as f64
    );
    for (name, (secs, rss)) in &rows {
        md.push_str(&format!(
            "| {name} | {secs:.3} s | {:.2}× | {:.1} MiB |\n",
            secs / floor,
            *rss as f64 / 1024.0
        ));
    }
    md.push_str(
        "\nTargets: uncompressed at most 1.1× the floor, gzip faster than umoci, zstd at most 1.3× the floor, \
         peak memory under 64 MiB.\n",
    );
    record_benchmark("build", &md)?;
    let _ = fs::remove_dir_all(&work);
    Ok(())
}
