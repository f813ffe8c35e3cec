//! `cargo xtask fuzz [--time S] [TARGET] [-- LIBFUZZER_ARGS]`: coverage-guided fuzzing of the
//! decoders that take bytes from outside (fuzz/targets), with libFuzzer through cargo-fuzz on a
//! nightly toolchain, each installed when missing. Every target (or the one named) runs for S
//! seconds from its seeds in fuzz/corpus/NAME (new inputs go to fuzz/target/corpus/NAME, so the
//! seeds stay the real data they are); a crash found is copied into fuzz/regressions/NAME, where
//! `cargo test` replays it on stable, and fails the task naming it. See docs/fuzzing.md.
use crate::util;
use anyhow::{Context, Result, bail};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// How the targets are built, the same for `build` and `run` (so a run rebuilds nothing): no
/// sanitizer, since the code fuzzed is safe Rust but for a few system calls, and AddressSanitizer
/// made the targets that start threads (the Docker runtime) or close redb files ten times slower
/// (its shadow memory's page faults); `--asan` asks for it. Sixteen codegen units: the large
/// crates build on every core.
fn build_flags(asan: bool) -> Vec<&'static str> {
    let sanitizer = if asan { "address" } else { "none" };
    vec!["--sanitizer", sanitizer, "--codegen-units", "16"]
}

/// What one target's run did, from libFuzzer's own report.
#[derive(Debug, Default)]
struct Ran {
    target: String,
    executions: Option<u64>,
    exec_per_s: Option<u64>,
    cov: Option<u64>,
    ft: Option<u64>,
    corpus: Option<String>,
    /// The count of the last status line, for runs without final stats (fork mode).
    seen: Option<u64>,
    /// Crash, leak, timeout and out-of-memory inputs found, as kept in fuzz/regressions.
    found: Vec<PathBuf>,
    failed: bool,
    /// libFuzzer's account of a failure (the panic, its summary, the input in Base64), shown
    /// again after the table: a CI log cut to its tail still says what failed and on what.
    why: Vec<String>,
}

pub fn run(time: u64, target: Option<&str>, asan: bool, extra: &[String]) -> Result<()> {
    let begun = std::time::Instant::now();
    install()?;
    let fuzz = util::root().join("fuzz");
    let all = targets(&fuzz)?;
    let chosen: Vec<String> = match target {
        Some(t) if all.iter().any(|a| a == t) => vec![t.to_string()],
        Some(t) => bail!("no fuzz target {t}: the targets are {}", all.join(", ")),
        None => all,
    };
    // One build for every target: the runs below find it done.
    let built = std::time::Instant::now();
    util::run(
        Command::new("cargo")
            .args(["+nightly", "fuzz", "build"])
            .args(build_flags(asan)),
    )?;
    eprintln!(
        "the fuzz targets built in {:.0} s",
        built.elapsed().as_secs_f64()
    );
    let mut report = Vec::new();
    for name in &chosen {
        report.push(run_one(&fuzz, name, time, asan, extra)?);
    }
    eprintln!();
    eprintln!(
        "{:<16} {:>12} {:>9} {:>7} {:>8} {:>14}  result",
        "target", "executions", "exec/s", "cov", "ft", "corpus"
    );
    let show = |v: Option<u64>| v.map_or("?".to_string(), |v| v.to_string());
    for r in &report {
        eprintln!(
            "{:<16} {:>12} {:>9} {:>7} {:>8} {:>14}  {}",
            r.target,
            show(r.executions),
            show(r.exec_per_s),
            show(r.cov),
            show(r.ft),
            r.corpus.as_deref().unwrap_or("?"),
            if r.found.is_empty() && !r.failed {
                "ok".to_string()
            } else if r.found.is_empty() {
                "failed".to_string()
            } else {
                format!("{} found", r.found.len())
            }
        );
    }
    for r in report.iter().filter(|r| !r.why.is_empty()) {
        eprintln!("{}:", r.target);
        for line in &r.why {
            eprintln!("  {line}");
        }
    }
    eprintln!("fuzzing took {:.0} s in all", begun.elapsed().as_secs_f64());
    let found: Vec<String> = report
        .iter()
        .flat_map(|r| r.found.iter().map(|p| p.display().to_string()))
        .collect();
    if !found.is_empty() {
        // The targets' scratch files live there: a full one fails a target as a crash would.
        let _ = Command::new("df").args(["-h", "/dev/shm", "/tmp"]).status();
        bail!(
            "fuzzing found {} failing input(s), kept for `cargo test` to replay: {}; fix the decoder (cargo test -p fuzz-targets replays them) and keep them there",
            found.len(),
            found.join(", ")
        );
    }
    if let Some(r) = report.iter().find(|r| r.failed) {
        bail!(
            "the fuzz target {} failed without an input to keep; see its output above",
            r.target
        );
    }
    Ok(())
}

/// The nightly toolchain and cargo-fuzz, installed when missing.
fn install() -> Result<()> {
    let toolchains = Command::new("rustup")
        .args(["toolchain", "list"])
        .output()
        .context("cannot run rustup: install it (https://rustup.rs) to fuzz")?;
    if !String::from_utf8_lossy(&toolchains.stdout)
        .lines()
        .any(|l| l.starts_with("nightly"))
    {
        util::run(Command::new("rustup").args([
            "toolchain",
            "install",
            "nightly",
            "--profile",
            "minimal",
        ]))?;
    }
    let have_fuzz = Command::new("cargo")
        .args(["+nightly", "fuzz", "--version"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !have_fuzz {
        util::run(Command::new("cargo").args(["install", "cargo-fuzz", "--locked"]))?;
    }
    Ok(())
}

/// The targets, by the names of fuzz/fuzz_targets/NAME.rs.
fn targets(fuzz: &Path) -> Result<Vec<String>> {
    let dir = fuzz.join("fuzz_targets");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .with_context(|| format!("cannot read {}", dir.display()))?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            e.file_name()
                .to_str()?
                .strip_suffix(".rs")
                .map(str::to_string)
        })
        .collect();
    names.sort();
    Ok(names)
}

/// The files of a folder (none when it does not exist).
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.is_file())
        .collect();
    v.sort();
    v
}

fn run_one(fuzz: &Path, name: &str, time: u64, asan: bool, extra: &[String]) -> Result<Ran> {
    let work = fuzz.join("target/corpus").join(name);
    let seeds = fuzz.join("corpus").join(name);
    let artifacts = fuzz.join("artifacts").join(name);
    std::fs::create_dir_all(&work)?;
    std::fs::create_dir_all(&artifacts)?;
    let before = files(&artifacts);
    let mut cmd = Command::new("cargo");
    cmd.args(["+nightly", "fuzz", "run"])
        .args(build_flags(asan))
        .arg(name)
        .arg(&work)
        .arg(&seeds)
        .arg("--")
        .arg(format!("-max_total_time={time}"))
        .args(["-print_final_stats=1", "-timeout=30", "-rss_limit_mb=4096"])
        .args(extra)
        .current_dir(util::root())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    eprintln!("$ cargo +nightly fuzz run {name} ({time} s)");
    let mut child = cmd.spawn().context("cannot start cargo fuzz run")?;
    // libFuzzer reports on stderr; stdout (the targets print nothing) is passed through.
    let stdout = child.stdout.take().expect("piped");
    let passing = std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            println!("{line}");
        }
    });
    let mut ran = Ran {
        target: name.to_string(),
        ..Ran::default()
    };
    let stderr = child.stderr.take().expect("piped");
    // The panic's message follows its `panicked at` line.
    let mut message_lines = 0;
    for line in BufReader::new(stderr).lines().map_while(Result::ok) {
        eprintln!("{line}");
        read_stats(&line, &mut ran);
        if message_lines > 0 || is_failure_line(&line) {
            message_lines = if line.contains("panicked at") {
                4
            } else {
                message_lines.max(1) - 1
            };
            if ran.why.len() < 40 {
                ran.why.push(line);
            }
        }
    }
    let status = child.wait()?;
    let _ = passing.join();
    ran.executions = ran.executions.or(ran.seen);
    let kept = fuzz.join("regressions").join(name);
    for artifact in files(&artifacts) {
        if before.contains(&artifact) {
            continue;
        }
        std::fs::create_dir_all(&kept)?;
        let to = kept.join(artifact.file_name().expect("a file name"));
        std::fs::copy(&artifact, &to)
            .with_context(|| format!("cannot keep {}", artifact.display()))?;
        eprintln!("{name}: kept {} as {}", artifact.display(), to.display());
        ran.found.push(to);
    }
    ran.failed = !status.success();
    Ok(ran)
}

/// A line of libFuzzer's (or the target's) account of a failure worth repeating at the end.
fn is_failure_line(line: &str) -> bool {
    line.contains("panicked at")
        || line.starts_with("==")
        || line.starts_with("SUMMARY:")
        || line.starts_with("Base64:")
        || line.starts_with("artifact_prefix=")
}

/// Notes what a libFuzzer line says: `#N ... cov: C ft: F corp: K/S exec/s: E` status lines
/// (the last one stands), and the final `stat::` lines of -print_final_stats.
fn read_stats(line: &str, ran: &mut Ran) {
    let number = |after: &str| -> Option<u64> {
        let at = line.find(after)? + after.len();
        line[at..]
            .split_whitespace()
            .next()?
            .trim_end_matches(|c: char| !c.is_ascii_digit())
            .parse()
            .ok()
    };
    if let Some(v) = line.strip_prefix("stat::number_of_executed_units:") {
        ran.executions = v.trim().parse().ok();
    } else if let Some(v) = line.strip_prefix("stat::average_exec_per_sec:") {
        ran.exec_per_s = v.trim().parse().ok();
    } else if line.starts_with('#') && line.contains("cov: ") {
        ran.cov = number("cov: ").or(ran.cov);
        ran.ft = number("ft: ").or(ran.ft);
        if let Some(at) = line.find("corp: ") {
            ran.corpus = line[at + 6..].split_whitespace().next().map(str::to_string);
        }
        ran.exec_per_s = number("exec/s: ").or(ran.exec_per_s);
        // `#N` counts the executions so far; the final stats, when printed, say the same.
        ran.seen = line[1..]
            .split(|c: char| !c.is_ascii_digit())
            .next()
            .and_then(|n| n.parse().ok())
            .or(ran.seen);
    }
}
