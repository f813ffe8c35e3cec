//! `cargo xtask bench content`: 1 GiB of incompressible bytes staged onto a node (an artifact
//! replicated through a one-time ticket: the node's whole copy, TLS, disk and hash) and a 1 GiB
//! file collected back (`collect --out`: the node's upload hashed as it is sent, the
//! coordinator's check, the move to --out), against `curl` over HTTPS on the same loopback moving the same bytes from
//! `openssl s_server` (the floor) and `scp` both ways through a private `sshd` on loopback, with
//! the peak RSS of the agent and the coordinator; and the import of the same bytes as a program
//! through a serving coordinator of two, held by one of them and by both (`--content-copies`).
//! With `--baseline REV` the agent and coordinator built from REV (`super::baseline`) do the same
//! beside this tree's: staging and collecting sample for sample, the imports one after the other.
use super::baseline::each;
use crate::cross;
use crate::fleet::{self, Coordinator, wait_for_log};
use crate::util::{measure, median, record_benchmark};
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const TARGET: &str = "x86_64-unknown-linux-musl";
const SAMPLES: usize = 3;
const SIZE_MIB: u64 = 1024;
/// What the bench runs: the agent, with the coordinator and the run supervisor beside it.
const PACKAGES: &[&str] = &["fleet-agent", "fleet-coordinator", "fleet-run-supervisor"];

/// A coordinator serving one node, both of one side's binaries.
struct Node {
    agent: fleet::Proc,
    coordinator: Coordinator,
    machine: PathBuf,
}

impl Node {
    /// Serves a coordinator and joins an agent to it (`bin`: the agent) in the folder `dir`.
    fn start(bin: &Path, dir: &Path) -> Result<Node> {
        let log = std::fs::File::create(dir.join("coordinator.log"))?;
        let coordinator = Coordinator::serve(bin, &dir.join("coord"), &[], Stdio::from(log))?;
        let machine = dir.join("machine");
        std::fs::create_dir_all(&machine)?;
        let join = machine.join("fleet.json");
        std::fs::write(&join, coordinator.cli(&["token", "--name", "bench"])?)?;
        let agent_log = machine.join("agent.log");
        let agent = fleet::Proc::spawn(
            fleet::agent(bin, &join, &machine)
                .arg("--artifact-root")
                .arg(machine.join("artifacts"))
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&agent_log)?),
        )?;
        wait_for_log(&agent_log, "session open", Duration::from_secs(30))?;
        Ok(Node {
            agent,
            coordinator,
            machine,
        })
    }

    /// One staging: the node's own timing of the whole copy, its artifact removed first.
    fn stage(&self, data: &str) -> Result<f64> {
        let _ = std::fs::remove_dir_all(self.machine.join("artifacts"));
        let copy: serde_json::Value = serde_json::from_str(&self.coordinator.cli(&[
            "replicate",
            "--node",
            "bench",
            "--file",
            data,
        ])?)?;
        let ms = copy["copy_ms"]
            .as_u64()
            .context("replicate printed no copy_ms")?;
        Ok(ms as f64 / 1000.0)
    }

    /// One `collect --out` of the run's `out.bin` to `out`, timed.
    fn collect(&self, run: &str, out: &Path) -> Result<f64> {
        let _ = std::fs::remove_file(out);
        let m = measure(
            Command::new(&self.coordinator.bin)
                .arg("--data")
                .arg(&self.coordinator.data)
                .args(["collect", "--run", run, "--path", "out.bin", "--out"])
                .arg(out)
                .stdout(Stdio::null()),
        )?;
        Ok(m.seconds)
    }
}

pub fn run(baseline: Option<&str>) -> Result<()> {
    cross::build_static(TARGET, PACKAGES)?;
    let ours = cross::target_dir().join(TARGET).join("release");
    let sides = super::baseline::sides(ours, baseline, Some(TARGET), PACKAGES)?;
    let bins: Vec<PathBuf> = sides.iter().map(|(_, r)| r.join("fleet-agent")).collect();
    let work = fleet::fresh_dir("bench-content")?;
    let data = work.join("data.bin");
    let head = Command::new("head")
        .args(["-c", &format!("{}", SIZE_MIB << 20), "/dev/urandom"])
        .stdout(std::fs::File::create(&data)?)
        .status()?;
    if !head.success() {
        bail!("cannot write {} of random bytes", data.display());
    }

    // One node for each side, serving at once: their samples alternate.
    let mut nodes = Vec::new();
    for (side, bin) in bins.iter().enumerate() {
        let dir = work.join(format!("side-{side}"));
        std::fs::create_dir_all(&dir)?;
        nodes.push(Node::start(bin, &dir)?);
    }
    let data_arg = data.to_string_lossy().into_owned();
    let mut stage_s = vec![vec![]; nodes.len()];
    for _ in 0..SAMPLES {
        for (side, node) in nodes.iter().enumerate() {
            stage_s[side].push(node.stage(&data_arg)?);
        }
    }

    // Collecting: a run that leaves the same bytes in its folder, collected whole to --out.
    let program = fleet::script(
        &work.join("leave.sh"),
        &format!("cp {} out.bin", data.display()),
    )?;
    let mut runs = Vec::new();
    for node in &nodes {
        let set = node.coordinator.run_set(&program, &["--timeout", "120s"])?;
        runs.push(finished_run(&node.coordinator, &set)?);
    }
    let out = work.join("collected.bin");
    let mut collect_s = vec![vec![]; nodes.len()];
    for _ in 0..SAMPLES {
        for (side, node) in nodes.iter().enumerate() {
            collect_s[side].push(node.collect(&runs[side], &out)?);
        }
    }
    let mut rss = Vec::new();
    for node in &nodes {
        let coordinator = peak_rss_mib(coordinator_pid(&node.coordinator)?)?;
        rss.push((coordinator, peak_rss_mib(node.agent.0.id())?));
    }
    drop(nodes);

    // The imports, one side after the other: each its own fleet of two on its own PostgreSQL.
    let mut imports = Vec::new();
    for (side, bin) in bins.iter().enumerate() {
        imports.push(import_with_copies(
            &work.join(format!("side-{side}")),
            bin,
            &data,
        )?);
    }
    let (one_write, two_writes) = disk_floor(&work, &data)?;
    let curl_s = curl_floor(&work, &data)?;
    let curl = median(&curl_s);
    let scp = scp_both_ways(&work, &data).map(|(to, from)| (median(&to), median(&from)));
    let mib = SIZE_MIB as f64;
    let row = |what: &str, s: f64| {
        format!(
            "| {what} | {s:.2} s | {:.0} MiB/s | {:.2}x |",
            mib / s,
            s / curl
        )
    };
    let name = |row: &str, side: usize| super::baseline::row_name(row, &sides[side].0, sides.len());
    let rows = |what: &str, samples: &[Vec<f64>]| {
        (samples.iter().enumerate())
            .map(|(side, s)| row(&name(what, side), median(s)))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let verdict = |samples: &[Vec<f64>]| {
        each(&sides, |side| match median(&samples[side]) / curl <= 1.2 {
            true => "meets".into(),
            false => "misses".into(),
        })
    };
    let scp_rows = match &scp {
        Ok((to, from)) => format!(
            "{}\n{}",
            row("scp to a local sshd", *to),
            row("scp from a local sshd", *from)
        ),
        Err(e) => format!("| scp over a local sshd | not measured: {e:#} | | |"),
    };
    let baseline_flag = baseline.map_or(String::new(), |r| format!(" --baseline {r}"));
    let alternate = match baseline {
        Some(_) => {
            " Each sample of this tree's binaries is followed by the same of the baseline's \
             (both nodes serving meanwhile); the imports run this tree's first, then the \
             baseline's."
        }
        None => "",
    };
    let markdown = format!(
        "## Content: 1 GiB staged and collected (`cargo xtask bench content{baseline_flag}`)\n\n\
         Static release binaries on loopback, {SIZE_MIB} MiB of incompressible bytes, median of \
         {SAMPLES}. Staged: an artifact replicated with a one-time ticket, as the node times the \
         whole copy (pinned TLS, disk write and SHA-256 in one pass, fsync and rename). Collected: \
         `collect --out` wall time (the node's upload of the run's file, read in place and \
         hashed as it is sent, the coordinator's check as the bytes land and their fsync, and \
         the rename to --out). Floor: `curl` downloading the same bytes over HTTPS from `openssl s_server \
         -WWW` (its whole process: start, handshake, transfer, write). Beside it: `scp` of the \
         same file to and from a private `sshd` on loopback (its own host key, \
         authorized_keys and config). Target: within 1.2x of the floor.{alternate}\n\n\
         | what | time | rate | vs curl |\n|---|---|---|---|\n{}\n{}\n{}\n{scp_rows}\n\n\
         Peak RSS after staging and collecting 1 GiB {SAMPLES} times each: {} (target: under 64 MiB).\n\n\
         Imported through a serving coordinator (`run` of a {SIZE_MIB} MiB program, no node \
         matching yet, so only the import is timed; two coordinators on one PostgreSQL, the \
         program's first bytes changed before each sample so each is new content), median of \
         {SAMPLES}: with `--content-copies 1` {}, with `--content-copies 2` (`run` \
         pushes the file to the other coordinator while it reads it, each side checking and \
         syncing its copy, before `run` returns) {}, \
         {} (target: at most +30%). The floor of a second copy on this machine, where \
         both coordinators write to one disk: `dd oflag=direct conv=fsync` of the same {SIZE_MIB} \
         MiB alone {one_write:.2} s, two at once {two_writes:.2} s ({floor:+.0}%).\n\n\
         Staging {} the 1.2x target; collecting {} it. A collect passes over the bytes once \
         on each side: the node reads the run's file in place and hashes it as it sends it, the \
         coordinator decrypts, hashes, writes and fsyncs it, and `collect --out` renames the \
         checked file into place.\n",
        rows("staged (node copy)", &stage_s),
        rows("collected (collect --out)", &collect_s),
        row("curl over HTTPS (floor)", curl),
        each(&sides, |side| format!(
            "coordinator {} MiB, agent {} MiB",
            rss[side].0, rss[side].1
        )),
        each(&sides, |side| format!("{:.2} s", imports[side].0)),
        each(&sides, |side| format!("{:.2} s", imports[side].1)),
        each(&sides, |side| format!(
            "{:+.0}%",
            (imports[side].1 / imports[side].0 - 1.0) * 100.0
        )),
        verdict(&stage_s),
        verdict(&collect_s),
        floor = (two_writes / one_write - 1.0) * 100.0,
    );
    record_benchmark("content", &markdown)?;
    println!("{markdown}");
    Ok(())
}

/// `run` of `data` as a program through a serving coordinator of a fleet of two on PostgreSQL,
/// once serving with `--content-copies 1` and once with 2: the medians of each, in seconds.
fn import_with_copies(work: &Path, agent: &Path, data: &Path) -> Result<(f64, f64)> {
    let cluster = super::postgres::Cluster::start(&work.join("pg"), 40)?;
    let url = cluster.url();
    let mut medians = Vec::new();
    for copies in ["1", "2"] {
        let dir = work.join(format!("copies-{copies}"));
        let (first, second) = (dir.join("a"), dir.join("b"));
        let log = |name: &str| std::fs::File::create(dir.join(name)).map(Stdio::from);
        std::fs::create_dir_all(&dir)?;
        // One fleet, one key (the store refuses another): made by the first coordinator served.
        let fleet_key = work.join("fleet.key");
        if fleet_key.exists() {
            std::fs::create_dir_all(&first)?;
            std::fs::copy(&fleet_key, first.join("coordinator.key"))?;
        }
        let flags = ["--store", url.as_str(), "--content-copies", copies];
        let a = Coordinator::serve(agent, &first, &flags, log("a.log")?)?;
        std::fs::copy(first.join("coordinator.key"), &fleet_key)?;
        std::fs::create_dir_all(&second)?;
        std::fs::copy(&fleet_key, second.join("coordinator.key"))?;
        let b = Coordinator::serve(agent, &second, &flags, log("b.log")?)?;
        let deadline = Instant::now() + Duration::from_secs(60);
        while !a.cli(&["token"])?.contains(&b.addr) {
            if Instant::now() > deadline {
                bail!("the two coordinators never knew each other");
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        // `--wait-for-match` came with issue 51, which refuses `--count` with no node matching
        // without it; a coordinator before it queues such a run as it is, and refuses the flag.
        let wait: &[&str] = match knows(&a.bin, "run", "--wait-for-match")? {
            true => &["--wait-for-match"],
            false => &[],
        };
        let mut samples = Vec::new();
        for sample in 0..SAMPLES {
            // New content each time: the first bytes changed in place, the size the same.
            let mut file = std::fs::OpenOptions::new().write(true).open(data)?;
            std::io::Write::write_all(&mut file, format!("{copies}-{sample}-").as_bytes())?;
            drop(file);
            let m = measure(
                Command::new(&a.bin)
                    .arg("--data")
                    .arg(&a.data)
                    .args(["run", "--where", "label.pool=none", "--count", "1"])
                    // No node matches: the run is queued, the program imported and copied.
                    .args(wait)
                    .arg("--program")
                    .arg(data)
                    .stdout(Stdio::null()),
            )?;
            samples.push(m.seconds);
        }
        medians.push(median(&samples));
        drop((a, b));
        // What the samples imported (a GiB each, on each holder) is not kept.
        std::fs::remove_dir_all(&dir)?;
    }
    drop(cluster);
    Ok((medians[0], medians[1]))
}

/// Whether `bin SUBCOMMAND --help` lists `flag`.
fn knows(bin: &Path, subcommand: &str, flag: &str) -> Result<bool> {
    let out = Command::new(bin).args([subcommand, "--help"]).output()?;
    if !out.status.success() {
        bail!(
            "{} {subcommand} --help failed: {}",
            bin.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).contains(flag))
}

/// The disk's own cost of a second copy: `data` written past the page cache and synced by `dd`,
/// once alone and twice at once (the medians, in seconds).
fn disk_floor(work: &Path, data: &Path) -> Result<(f64, f64)> {
    let dd = |to: &str| {
        let mut cmd = Command::new("dd");
        cmd.arg(format!("if={}", data.display()))
            .arg(format!("of={}", work.join(to).display()))
            .args(["bs=1M", "oflag=direct", "conv=fsync", "status=none"]);
        cmd
    };
    let (mut alone, mut together) = (Vec::new(), Vec::new());
    for _ in 0..SAMPLES {
        alone.push(measure(&mut dd("floor-a"))?.seconds);
        let began = Instant::now();
        let (mut a, mut b) = (dd("floor-a").spawn()?, dd("floor-b").spawn()?);
        let (a, b) = (a.wait()?, b.wait()?);
        if !a.success() || !b.success() {
            bail!("dd of {} failed: {a}, {b}", data.display());
        }
        together.push(began.elapsed().as_secs_f64());
        for name in ["floor-a", "floor-b"] {
            std::fs::remove_file(work.join(name))?;
        }
    }
    Ok((median(&alone), median(&together)))
}

/// Waits for the set's one row to finish; returns its run id.
fn finished_run(coordinator: &Coordinator, set: &str) -> Result<String> {
    let deadline = Instant::now() + Duration::from_secs(120);
    while Instant::now() < deadline {
        let rows: serde_json::Value =
            serde_json::from_str(&coordinator.cli(&["status", "--set", set, "--json"])?)?;
        let row = &rows[0];
        match row["state"].as_str() {
            Some("finished") => return Ok(row["run_id"].as_str().unwrap_or_default().into()),
            Some("failed" | "lost") => bail!("the collect run ended {row}"),
            _ => std::thread::sleep(Duration::from_millis(200)),
        }
    }
    bail!("the collect run did not finish within 120 s")
}

/// The process id of the `fleet-coordinator serve` serving the bench's data folder.
fn coordinator_pid(coordinator: &Coordinator) -> Result<u32> {
    let data = coordinator.data.to_string_lossy().into_owned();
    for entry in std::fs::read_dir("/proc")? {
        let Ok(pid) = entry?.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        if args.contains(&data.as_bytes()) && args.contains(&&b"serve"[..]) {
            return Ok(pid);
        }
    }
    bail!("cannot find the coordinator serving {data}")
}

fn peak_rss_mib(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .context("no VmHWM")?;
    Ok(kib >> 10)
}

/// `scp` of `data` to and then from a private `sshd` on loopback (its own host and client
/// keys, authorized_keys and config, in the foreground), SAMPLES times each way.
fn scp_both_ways(work: &Path, data: &Path) -> Result<(Vec<f64>, Vec<f64>)> {
    let sshd = Path::new("/usr/sbin/sshd");
    if !sshd.exists() || !crate::util::have("scp") {
        bail!("no sshd or scp here (Debian: openssh-server, openssh-client)");
    }
    let dir = work.join("ssh");
    std::fs::create_dir_all(&dir)?;
    for key in ["host_key", "client_key"] {
        let made = Command::new("ssh-keygen")
            .args(["-q", "-t", "ed25519", "-N", "", "-f"])
            .arg(dir.join(key))
            .status()?;
        if !made.success() {
            bail!("ssh-keygen could not make {key}");
        }
    }
    std::fs::copy(dir.join("client_key.pub"), dir.join("authorized_keys"))?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let config = dir.join("sshd_config");
    std::fs::write(
        &config,
        format!(
            "Port {port}\nListenAddress 127.0.0.1\nHostKey {}\nAuthorizedKeysFile {}\n\
             PidFile none\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n\
             PubkeyAuthentication yes\nUsePAM no\nStrictModes no\n\
             Subsystem sftp internal-sftp\n",
            dir.join("host_key").display(),
            dir.join("authorized_keys").display(),
        ),
    )?;
    // sshd run as root wants its privilege separation folder, which the system service makes.
    let _ = std::fs::create_dir_all("/run/sshd");
    let log = dir.join("sshd.log");
    let mut server = fleet::Proc::spawn(
        Command::new(sshd)
            .args(["-D", "-e", "-f"])
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?),
    )?;
    wait_for_log(&log, "Server listening", Duration::from_secs(10))
        .with_context(|| std::fs::read_to_string(&log).unwrap_or_default())?;
    let user = String::from_utf8(Command::new("id").arg("-un").output()?.stdout)?;
    let remote = format!("{}@127.0.0.1:", user.trim());
    let scp = |from: &str, to: &str| -> Result<f64> {
        let m = measure(
            Command::new("scp")
                .args(["-q", "-P", &port.to_string(), "-i"])
                .arg(dir.join("client_key"))
                .args(["-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no"])
                .args(["-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR"])
                .args([from, to]),
        )?;
        Ok(m.seconds)
    };
    let (up, down) = (dir.join("up.bin"), dir.join("down.bin"));
    let (data, up, down) = (
        data.to_string_lossy(),
        up.to_string_lossy(),
        down.to_string_lossy(),
    );
    let (mut to, mut from) = (Vec::new(), Vec::new());
    for _ in 0..SAMPLES {
        to.push(scp(&data, &format!("{remote}{up}"))?);
        from.push(scp(&format!("{remote}{up}"), &down)?);
        if std::fs::metadata(&*down)?.len() != SIZE_MIB << 20 {
            bail!(
                "scp moved {} bytes, not the whole file",
                std::fs::metadata(&*down)?.len()
            );
        }
    }
    server.stop();
    Ok((to, from))
}

/// `curl` fetching `data` over HTTPS from `openssl s_server -WWW` on loopback, SAMPLES times.
fn curl_floor(work: &Path, data: &Path) -> Result<Vec<f64>> {
    let (cert, key) = (work.join("tls.crt"), work.join("tls.key"));
    let made = Command::new("openssl")
        .args([
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        ])
        .args([
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()?;
    if !made.success() {
        bail!("openssl could not make a certificate");
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let mut server = fleet::Proc::spawn(
        Command::new("openssl")
            .args(["s_server", "-quiet", "-WWW", "-accept", &port.to_string()])
            .arg("-cert")
            .arg(&cert)
            .arg("-key")
            .arg(&key)
            .current_dir(data.parent().context("data has a folder")?)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    )?;
    std::thread::sleep(Duration::from_millis(500));
    let name = data
        .file_name()
        .context("data has a name")?
        .to_string_lossy();
    let url = format!("https://127.0.0.1:{port}/{name}");
    let out = work.join("curl.bin");
    let mut samples = Vec::new();
    for _ in 0..SAMPLES {
        let m = measure(
            Command::new("curl")
                .args(["-sS", "--cacert"])
                .arg(&cert)
                .arg("-o")
                .arg(&out)
                .arg(&url),
        )?;
        if std::fs::metadata(&out)?.len() != SIZE_MIB << 20 {
            bail!(
                "curl fetched {} bytes, not the whole file",
                std::fs::metadata(&out)?.len()
            );
        }
        samples.push(m.seconds);
    }
    server.stop();
    Ok(samples)
}
