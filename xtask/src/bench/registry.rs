//! `cargo xtask bench registry`: `oci push`/`oci copy` side by side with `skopeo copy` and a curl floor.
//!
//! Two real `docker-registry` processes on loopback. Every run gets a fresh target repository and
//! skopeo's blob-info cache is removed first, so neither tool can mount or skip what it should send.
//! The floor is the same blobs sent with curl as parallel monolithic PUTs, with no client hashing.
//! With `--baseline REV` the `oci` built from REV (`super::baseline`) runs after this tree's, each
//! time.
use crate::cross;
use crate::util::{self, Measured, measure, median, record_benchmark};
use anyhow::{Context, Result, bail};
use std::collections::HashMap;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const RUNS: usize = 5;
/// Four layers of 256 MiB: about 1 GiB, incompressible.
const LAYERS: usize = 4;
const LAYER_MIB: usize = 256;
const BIG_MIB: usize = 2048;
const SKOPEO_CACHE: &str = "/var/lib/containers/cache/blob-info-cache-v1.boltdb";

pub(crate) struct Registry {
    child: Child,
    pub(crate) host: String,
    pub(crate) log: PathBuf,
}

impl Registry {
    pub(crate) fn start(dir: &Path, name: &str) -> Result<Registry> {
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let host = format!("127.0.0.1:{port}");
        let data = dir.join(name);
        std::fs::create_dir_all(&data)?;
        let config = data.join("config.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: warn\n  formatter: text\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: {host}\n",
                data.join("storage").display()
            ),
        )?;
        let log = data.join("registry.log");
        let file = std::fs::File::create(&log)?;
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(&config)
            .stdout(file.try_clone()?)
            .stderr(file)
            .stdin(Stdio::null())
            .spawn()
            .context("cannot start docker-registry (cargo xtask ci installs it)")?;
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(&host).is_err() {
            if Instant::now() > deadline {
                bail!("docker-registry did not listen on {host}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(Registry { child, host, log })
    }

    fn image(&self, repo: &str) -> String {
        format!("docker://{}/{repo}", self.host)
    }

    /// Blob bytes the registry took into `repo` (completed upload PUTs and PATCH chunks).
    fn uploaded(&self, repo: &str, sizes: &HashMap<String, u64>) -> Result<(usize, u64)> {
        let log = std::fs::read_to_string(&self.log)?;
        let prefix = format!("/v2/{repo}/blobs/uploads/");
        let (mut requests, mut bytes) = (0, 0);
        for line in log.lines().filter(|l| l.contains(&prefix)) {
            if line.contains("\"PATCH ") {
                requests += 1;
            } else if line.contains("\"PUT ") {
                requests += 1;
                if let Some(d) = line
                    .split("digest=")
                    .nth(1)
                    .and_then(|s| s.split([' ', '&']).next())
                {
                    bytes += sizes.get(&d.replace("%3A", ":")).copied().unwrap_or(0);
                }
            }
        }
        Ok((requests, bytes))
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn run(baseline: Option<&str>) -> Result<()> {
    for tool in ["docker-registry", "skopeo", "curl"] {
        if !util::have(tool) {
            bail!("{tool} is missing: run cargo xtask ci once to install the benchmark's peers");
        }
    }
    util::run(Command::new("cargo").args(["build", "--release", "-p", "oci"]))?;
    let sides = super::baseline::sides(
        cross::target_dir().join("release"),
        baseline,
        None,
        &["oci"],
    )?;
    let tools: Vec<(String, PathBuf)> = (sides.into_iter())
        .map(|(name, release)| (name, release.join("oci")))
        .collect();
    let work = std::env::temp_dir().join(format!("oci-bench-registry-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let result = bench(&tools, &work, baseline);
    let _ = std::fs::remove_dir_all(&work);
    result
}

/// A side's repository: this tree's named as before, the baseline's with `base-` before it.
fn repo(side: usize, name: &str) -> String {
    match side {
        0 => name.to_string(),
        _ => format!("base-{name}"),
    }
}

/// `tools`: this tree's `oci` first (it builds the layouts and pushes the copies' sources),
/// then the baseline's; each side's runs come right after this tree's, run by run.
fn bench(tools: &[(String, PathBuf)], work: &Path, baseline: Option<&str>) -> Result<()> {
    let oci = &tools[0].1;
    let name = |row: &str, side: usize| super::baseline::row_name(row, &tools[side].0, tools.len());
    eprintln!(
        "making a layout of {LAYERS} x {LAYER_MIB} MiB incompressible layers and one of a {BIG_MIB} MiB layer"
    );
    let layout = work.join("layout");
    for i in 0..LAYERS {
        let base = (i > 0).then(|| format!("l{}", i - 1));
        build_layer(
            oci,
            work,
            &layout,
            &format!("l{i}"),
            LAYER_MIB,
            base.as_deref(),
        )?;
    }
    let image = format!("l{}", LAYERS - 1);
    let big_layout = work.join("big");
    build_layer(oci, work, &big_layout, "big", BIG_MIB, None)?;
    let blobs = blobs_of(&layout, &image)?;
    let sizes: HashMap<String, u64> = blobs.iter().map(|(d, s)| (d.clone(), *s)).collect();
    let total: u64 = blobs.iter().map(|(_, s)| s).sum();
    let a = Registry::start(work, "a")?;
    let b = Registry::start(work, "b")?;
    let src = format!("oci:{}:{image}", layout.display());

    let (mut t_oci, mut t_skopeo, mut t_curl) = (vec![vec![]; tools.len()], vec![], vec![]);
    for n in 0..RUNS {
        t_curl.push(
            measure(Command::new("sh").arg(curl_script(
                work,
                &Source::Layout(&layout),
                &blobs,
                &a.host,
                &format!("curl-{n}"),
            )?))?
            .seconds,
        );
        clear_skopeo_cache();
        t_skopeo.push(
            measure(skopeo().args([
                "--dest-tls-verify=false",
                &src,
                &a.image(&format!("skopeo-{n}:1")),
            ]))?
            .seconds,
        );
        for (side, (_, oci)) in tools.iter().enumerate() {
            t_oci[side].push(
                measure(quiet(Command::new(oci).args([
                    "push",
                    &src,
                    &a.image(&format!("{}:1", repo(side, &format!("oci-{n}")))),
                    "--plain-http",
                ])))?
                .seconds,
            );
        }
    }
    // Every side copies the same source: this tree's first push.
    let from = a.image("oci-0:1");
    let (mut c_oci, mut c_skopeo, mut c_curl) = (vec![vec![]; tools.len()], vec![], vec![]);
    for n in 0..RUNS {
        let script = curl_script(
            work,
            &Source::Registry(&a.host, "oci-0"),
            &blobs,
            &b.host,
            &format!("curl-{n}"),
        )?;
        c_curl.push(measure(Command::new("sh").arg(script))?.seconds);
        clear_skopeo_cache();
        c_skopeo.push(
            measure(skopeo().args([
                "--src-tls-verify=false",
                "--dest-tls-verify=false",
                &from,
                &b.image(&format!("skopeo-{n}:1")),
            ]))?
            .seconds,
        );
        for (side, (_, oci)) in tools.iter().enumerate() {
            c_oci[side].push(
                measure(quiet(Command::new(oci).args([
                    "copy",
                    &from,
                    &b.image(&format!("{}:1", repo(side, &format!("oci-{n}")))),
                    "--plain-http",
                ])))?
                .seconds,
            );
        }
    }
    // Repeat copies into the first targets: what each sends the second time.
    clear_skopeo_cache();
    let mut repeat_rows = String::new();
    for (side, (_, oci)) in tools.iter().enumerate() {
        let before = b.uploaded(&repo(side, "oci-0"), &sizes)?;
        let r = measure(quiet(Command::new(oci).args([
            "copy",
            &from,
            &b.image(&format!("{}:1", repo(side, "oci-0"))),
            "--plain-http",
        ])))?;
        let after = b.uploaded(&repo(side, "oci-0"), &sizes)?;
        repeat_rows += &format!(
            "| {} | {:.2} s | {} | {} |\n",
            name("oci copy", side),
            r.seconds,
            after.0 - before.0,
            after.1 - before.1
        );
    }
    let before_skopeo = b.uploaded("skopeo-0", &sizes)?;
    let r_skopeo = measure(skopeo().args([
        "--src-tls-verify=false",
        "--dest-tls-verify=false",
        &from,
        &b.image("skopeo-0:1"),
    ]))?;
    let after_skopeo = b.uploaded("skopeo-0", &sizes)?;
    let firsts = (0..tools.len())
        .map(|side| b.uploaded(&repo(side, "oci-1"), &sizes))
        .collect::<Result<Vec<_>>>()?;

    // Peak memory for one 2 GiB layer, registry to registry.
    util::run(Command::new(oci).args([
        "push",
        &format!("oci:{}:big", big_layout.display()),
        &a.image("big:1"),
        "--plain-http",
        "--quiet",
    ]))?;
    clear_skopeo_cache();
    let m_skopeo = measure(skopeo().args([
        "--src-tls-verify=false",
        "--dest-tls-verify=false",
        &a.image("big:1"),
        &b.image("big-skopeo:1"),
    ]))?;
    let mib = |m: &Measured| m.max_rss_kib as f64 / 1024.0;
    let mut big_rows = String::new();
    for (side, (_, oci)) in tools.iter().enumerate() {
        let m = measure(quiet(Command::new(oci).args([
            "copy",
            &a.image("big:1"),
            &b.image(&format!("{}:1", repo(side, "big-oci"))),
            "--plain-http",
        ])))?;
        big_rows += &format!(
            "| {} | {:.2} s | {:.1} MiB |\n",
            name("oci copy", side),
            m.seconds,
            mib(&m)
        );
    }

    let referrers = referrers_rows(tools, work, &a, &b, &from)?;

    let floor = median(&t_curl);
    let gib = total as f64 / (1u64 << 30) as f64;
    let copy_floor = median(&c_curl);
    let row = |name: &str, t: f64| {
        format!(
            "| {name} | {t:.2} s | {:.0} MiB/s | {:.2}x | {:.2}x |",
            gib * 1024.0 / t,
            t / floor,
            t / copy_floor
        )
    };
    let rows = |what: &str, times: &[Vec<f64>]| -> String {
        (times.iter().enumerate())
            .map(|(side, t)| row(&name(what, side), median(t)))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let baseline_flag = baseline.map_or(String::new(), |r| format!(" --baseline {r}"));
    let sides = match baseline {
        Some(_) => " Each run of this tree's `oci` is followed by the same run of the baseline's.",
        None => "",
    };
    let md = format!(
        "## registry\n\n\
         `cargo xtask bench registry{baseline_flag}`: {LAYERS} incompressible layers of {LAYER_MIB} MiB ({total} bytes with the config) built by \
         `oci build --compression none`, pushed to and copied between two `docker-registry` (distribution 2.8) processes over \
         plain HTTP on loopback. Median of {RUNS} runs, each into a fresh repository, skopeo's blob-info cache removed before each \
         skopeo run, `skopeo copy --preserve-digests`. The floor is the same blobs sent by curl as parallel monolithic PUTs (POST \
         then `PUT --upload-file`), no client-side hashing. Registry to registry, the floor moves: the copy floor is the same \
         blobs piped by curl from a GET on the source into the PUT, all at once. Ratios are to each floor.{sides}\n\n\
         | push from a layout | median | throughput | / push floor | / copy floor |\n|---|---|---|---|---|\n{}\n{}\n{}\n\n\
         | copy registry to registry | median | throughput | / push floor | / copy floor |\n|---|---|---|---|---|\n{}\n{}\n{}\n\n\
         | repeat copy into the same target | time | blob uploads | blob bytes uploaded |\n|---|---|---|---|\n\
         {repeat_rows}| skopeo copy | {:.2} s | {} | {} |\n\n\
         (The first oci copy into a fresh repository uploaded {}.)\n\n\
         | copy one {BIG_MIB} MiB layer, registry to registry | time | peak RSS |\n|---|---|---|\n\
         {big_rows}| skopeo copy | {:.2} s | {:.1} MiB |\n\n\
         Peak RSS is the tool's own (wait4 ru_maxrss); the registries are separate processes.\n\n{referrers}",
        row("curl floor (parallel PUTs)", floor),
        rows("oci push", &t_oci),
        row("skopeo copy", median(&t_skopeo)),
        row("curl copy floor (GET piped into PUT, parallel)", copy_floor),
        rows("oci copy", &c_oci),
        row("skopeo copy", median(&c_skopeo)),
        r_skopeo.seconds,
        after_skopeo.0 - before_skopeo.0,
        after_skopeo.1 - before_skopeo.1,
        super::baseline::each(tools, |side| format!(
            "{} blobs, {} bytes",
            firsts[side].0, firsts[side].1
        )),
        m_skopeo.seconds,
        mib(&m_skopeo),
    );
    eprintln!("{md}");
    record_benchmark("registry", &md)
}

/// Copies of an image carrying ten referrers (`oci attach`, the fallback tag schema of
/// distribution 2.8) against the same copies with `--no-referrers`: the 1 GiB image above, and a
/// 1 MiB one, where the referrers' requests weigh most; by each of `tools` in turn.
fn referrers_rows(
    tools: &[(String, PathBuf)],
    work: &Path,
    a: &Registry,
    b: &Registry,
    big: &str,
) -> Result<String> {
    const REFERRERS: usize = 10;
    let oci = &tools[0].1;
    let small_layout = work.join("small");
    build_layer(oci, work, &small_layout, "small", 1, None)?;
    let small = a.image("small:1");
    util::run(Command::new(oci).args([
        "push",
        &format!("oci:{}:small", small_layout.display()),
        &small,
        "--plain-http",
        "--quiet",
    ]))?;
    let mut rows = String::new();
    for (what, image) in [("1 GiB image", big), ("1 MiB image", small.as_str())] {
        for i in 0..REFERRERS {
            let file = work.join(format!("referrer-{i}.json"));
            std::fs::write(&file, format!("{{\"referrer\":{i}}}"))?;
            util::run(Command::new(oci).stdout(Stdio::null()).args([
                "attach",
                image,
                "--artifact-type",
                &format!("application/vnd.fleet.bench{i}+json"),
                "--file",
                file.to_str().context("a UTF-8 temporary path")?,
                "--plain-http",
            ]))?;
        }
        let (mut carried, mut left) = (vec![vec![]; tools.len()], vec![vec![]; tools.len()]);
        let tag = what.split_whitespace().nth(1).unwrap_or("x").to_lowercase();
        for n in 0..RUNS {
            for (side, (_, oci)) in tools.iter().enumerate() {
                let to =
                    |how: &str| b.image(&format!("{}:1", repo(side, &format!("{how}-{tag}-{n}"))));
                left[side].push(
                    measure(quiet(Command::new(oci).args([
                        "copy",
                        image,
                        &to("norefs"),
                        "--plain-http",
                        "--no-referrers",
                    ])))?
                    .seconds,
                );
                carried[side].push(
                    measure(quiet(Command::new(oci).args([
                        "copy",
                        image,
                        &to("refs"),
                        "--plain-http",
                    ])))?
                    .seconds,
                );
            }
        }
        for (side, (name, _)) in tools.iter().enumerate() {
            let (c, l) = (median(&carried[side]), median(&left[side]));
            let what = super::baseline::row_name(what, name, tools.len());
            rows += &format!("| {what} | {c:.3} s | {l:.3} s | {:.2}x |\n", c / l);
        }
    }
    Ok(format!(
        "| copy with {REFERRERS} referrers (fallback tag) | carried (default) | `--no-referrers` | ratio |\n|---|---|---|---|\n{rows}\n\
         Each referrer is an `oci attach` of a small JSON file; median of {RUNS} copies each way, alternating, each into a fresh \
         repository of the second registry.\n"
    ))
}

/// One `oci build` of a folder holding `mib` MiB from /dev/urandom, optionally on a base image.
fn build_layer(
    oci: &Path,
    work: &Path,
    layout: &Path,
    name: &str,
    mib: usize,
    base: Option<&str>,
) -> Result<()> {
    let root = work.join(format!("root-{name}"));
    std::fs::create_dir_all(&root)?;
    util::run(Command::new("dd").args([
        "if=/dev/urandom",
        &format!("of={}", root.join("data").display()),
        "bs=1M",
        &format!("count={mib}"),
        "status=none",
    ]))?;
    let mut cmd = Command::new(oci);
    cmd.args(["build", "--compression", "none", "--ref", name])
        .arg("--layout")
        .arg(layout)
        .arg("--root")
        .arg(&root);
    if let Some(b) = base {
        cmd.arg("--base-layout").arg(layout).args(["--base-ref", b]);
    }
    util::run(cmd.stdout(Stdio::null()))?;
    std::fs::remove_dir_all(&root)?;
    Ok(())
}

/// The config and layer digests and sizes of a layout's image, read from its manifest.
fn blobs_of(layout: &Path, name: &str) -> Result<Vec<(String, u64)>> {
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(layout.join("index.json"))?)?;
    let entry = index["manifests"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|m| m["annotations"]["org.opencontainers.image.ref.name"] == name)
        .context("the benchmark image is in index.json")?;
    let manifest: serde_json::Value = serde_json::from_slice(&std::fs::read(blob_path(
        layout,
        entry["digest"].as_str().unwrap_or(""),
    ))?)?;
    let mut blobs = vec![];
    for d in std::iter::once(&manifest["config"])
        .chain(manifest["layers"].as_array().into_iter().flatten())
    {
        blobs.push((
            d["digest"].as_str().unwrap_or("").to_string(),
            d["size"].as_u64().unwrap_or(0),
        ));
    }
    Ok(blobs)
}

fn blob_path(layout: &Path, digest: &str) -> PathBuf {
    layout
        .join("blobs/sha256")
        .join(digest.trim_start_matches("sha256:"))
}

/// Where the curl floor reads blobs: layout files, or another registry's repository.
enum Source<'a> {
    Layout(&'a Path),
    Registry(&'a str, &'a str),
}

/// A shell script that uploads every blob at once, each as POST + one monolithic PUT: from a file
/// (`--upload-file`), or piped from a GET on the source registry.
fn curl_script(
    work: &Path,
    source: &Source,
    blobs: &[(String, u64)],
    host: &str,
    repo: &str,
) -> Result<PathBuf> {
    let put = "curl -sSf -X PUT -H 'Content-Type: application/octet-stream' -o /dev/null";
    let send = match source {
        Source::Layout(_) => format!("{put} --upload-file \"$1\" \"$loc&digest=$2\""),
        Source::Registry(..) => {
            format!("curl -sSf \"$1\" | {put} --upload-file - \"$loc&digest=$2\"")
        }
    };
    let mut s = format!(
        "set -e\nup() {{\n  loc=$(curl -sSf -X POST -o /dev/null -w '%header{{location}}' \"http://$H/v2/$R/blobs/uploads/\")\n  {send}\n}}\n"
    );
    s += &format!("H={host}\nR={repo}\npids=\n");
    for (digest, _) in blobs {
        let from = match source {
            Source::Layout(layout) => blob_path(layout, digest).display().to_string(),
            Source::Registry(h, r) => format!("http://{h}/v2/{r}/blobs/{digest}"),
        };
        s += &format!("up {from} {digest} & pids=\"$pids $!\"\n");
    }
    s += "for p in $pids; do wait $p; done\n";
    let path = work.join(format!("{repo}.sh"));
    std::fs::write(&path, s)?;
    Ok(path)
}

fn skopeo() -> Command {
    let mut c = Command::new("skopeo");
    c.args(["--insecure-policy", "copy", "--quiet", "--preserve-digests"]);
    c
}

fn quiet(cmd: &mut Command) -> &mut Command {
    cmd.arg("--quiet").stdout(Stdio::null())
}

/// skopeo remembers where blobs were seen and would mount or skip them; each run starts without it.
fn clear_skopeo_cache() {
    let _ = std::fs::remove_file(SKOPEO_CACHE);
}
