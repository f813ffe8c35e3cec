//! `cargo xtask bench container`: one image by digest, run through the coordinator and the
//! agent's Docker runtime, and with `docker run`, side by side in one run: from the command to
//! the container running, and to the run finished, median of SAMPLES each. The image (a static
//! busybox built with `oci build`) is pushed to a loopback `docker-registry` and pulled once;
//! the registry's log then shows what the repeat runs fetched (nothing, if no pull happens).
use super::registry::Registry;
use crate::fleet::{self, Coordinator, wait_for_line};
use crate::util::{self, measure, median, record_benchmark};
use anyhow::{Context, Result, bail};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const SAMPLES: usize = 20;
/// The pause between two polls of our run's status.
const POLL: Duration = Duration::from_millis(2);

pub fn run() -> Result<()> {
    for tool in ["docker-registry", "docker", "busybox"] {
        if !util::have(tool) {
            bail!(
                "{tool} is missing: the container benchmark needs the Docker engine, docker-registry and busybox-static"
            );
        }
    }
    let agent_bin = fleet::build_release()?;
    let oci = agent_bin.with_file_name("oci");
    let work = fleet::fresh_dir("bench-container")?;
    let registry = Registry::start(&work, "registry")?;
    let image = busybox_image(&oci, &work, &registry.host)?;

    // The default heartbeat: a run's start and end reach the agent from the engine, not from
    // its periodic watch.
    let mut coordinator = Coordinator::serve(&agent_bin, &work.join("coord"), &[], Stdio::null())?;
    let machine = work.join("machine");
    std::fs::create_dir_all(&machine)?;
    let join = machine.join("fleet.json");
    std::fs::write(&join, coordinator.cli(&["token"])?)?;
    let mut agent = fleet::Proc::spawn(
        fleet::agent(&agent_bin, &join, &machine)
            .stdout(Stdio::null())
            .stderr(Stdio::piped()),
    )?;
    let mut lines = BufReader::new(agent.0.stderr.take().expect("piped")).lines();
    wait_for_line(&mut lines, "session open")?;
    let drain = std::thread::spawn(move || lines.for_each(drop));

    // The first run pulls the image; every later one must find it present.
    let begun = Instant::now();
    ours(&coordinator, &image, "true", "finished")?;
    let first_s = begun.elapsed().as_secs_f64();
    let before = blob_gets(&registry.log)?;
    let (mut ours_running, mut ours_finished) = (Vec::new(), Vec::new());
    let (mut cli_running, mut cli_finished) = (Vec::new(), Vec::new());
    for _ in 0..SAMPLES {
        ours_running.push(ours(&coordinator, &image, "sleep 1", "running")?);
        ours_finished.push(ours(&coordinator, &image, "true", "finished")?);
        let m = measure(
            Command::new("docker")
                .args(["run", "-d", "--init", &image, "-c", "sleep 1"])
                .stdout(Stdio::null()),
        )?;
        cli_running.push(m.seconds * 1000.0);
        let m = measure(
            Command::new("docker")
                .args(["run", "--init", &image, "-c", "true"])
                .stdout(Stdio::null()),
        )?;
        cli_finished.push(m.seconds * 1000.0);
    }
    let repeat_gets = blob_gets(&registry.log)? - before;
    agent.stop();
    let _ = drain.join();
    coordinator.stop();
    // The CLI's containers are not labelled; ours are removed with the machine's by label.
    remove_containers(&["ancestor", &image])?;
    Command::new("docker")
        .args(["rmi", "-f", &image])
        .stdout(Stdio::null())
        .status()?;

    let (or, of, cr, cf) = (
        median(&ours_running),
        median(&ours_finished),
        median(&cli_running),
        median(&cli_finished),
    );
    let markdown = format!(
        "## container\n\n\
         `cargo xtask bench container`: a static busybox image (`oci build`, gzip) by digest from a \
         loopback `docker-registry`, on the local Docker engine, median of {SAMPLES} each, in one \
         run. Ours: `fleet-coordinator run --image` through a serving coordinator (default \
         heartbeat, 5 s) and one agent (release builds, as shipped; the `docker` binaries are release builds too), timed from the command until the set's \
         status (asked on the operator socket every {poll} ms, as `status` does, without a \
         process per poll) shows the row running (`sleep 1`) or finished (`true`). Peer: `docker run -d --init` returning \
         (started) and `docker run --init` returning (finished), the same image by digest.\n\n\
         | from the command to | ours (coordinator + agent) | `docker run` |\n\
         |---|---|---|\n\
         | running | {or:.0} ms | {cr:.0} ms |\n\
         | finished | {of:.0} ms | {cf:.0} ms |\n\n\
         Target: no slower than the `docker` CLI. Ours / CLI: {rr:.2}x to running, {fr:.2}x to \
         finished{verdict}.\n\n\
         First run (pulls the image): {first_s:.2} s. Blob GETs at the registry over the {n} repeat \
         runs of ours and the CLI's: {repeat_gets} (a repeat run pulls 0 bytes). Ours includes what \
         the CLI does not: the coordinator's durable row, the dispatch to the node over its \
         session, the node's durable op and event records, and the status polls; the run's end reaches the agent from the engine's event stream, not its watch.\n",
        n = 2 * SAMPLES,
        poll = POLL.as_millis(),
        rr = or / cr,
        fr = of / cf,
        verdict = if or <= cr && of <= cf {
            ": met"
        } else {
            ": not met yet"
        },
    );
    println!("{markdown}");
    record_benchmark("container", &markdown)
}

/// `fleet-coordinator run --all --image IMAGE -- -c SCRIPT`, then the set's status polled until
/// the row reaches `state` (or a final state); returns milliseconds from the command. The polls
/// go straight to the operator socket, as the CLI's `status` would, but without a process each
/// (which would take this 2-core machine's CPU from the run being timed).
fn ours(coordinator: &Coordinator, image: &str, script: &str, state: &str) -> Result<f64> {
    let begun = Instant::now();
    let set = coordinator.cli(&["run", "--all", "--image", image, "--", "-c", script])?;
    let status = serde_json::json!({"op": "status", "set": set.trim()});
    loop {
        let rows = coordinator.ask(&status, "status")?;
        let row = &rows[0];
        if row["state"] == state {
            return Ok(begun.elapsed().as_secs_f64() * 1000.0);
        }
        if matches!(row["state"].as_str(), Some("finished" | "failed" | "lost")) {
            bail!(
                "the run ended {} before it was {state}: {row}",
                row["state"]
            );
        }
        if begun.elapsed() > Duration::from_secs(60) {
            bail!("the run was not {state} after 60 s: {row}");
        }
        std::thread::sleep(POLL);
    }
}

/// Builds the busybox image with `oci build`, pushes it, returns `HOST/bench/sh@sha256:HEX`.
pub(crate) fn busybox_image(oci: &Path, work: &Path, host: &str) -> Result<String> {
    let root = work.join("busybox-root");
    std::fs::create_dir_all(root.join("bin"))?;
    std::fs::copy("/bin/busybox", root.join("bin/busybox")).context("cannot copy /bin/busybox")?;
    for applet in ["sh", "sleep", "true", "echo", "cat"] {
        std::os::unix::fs::symlink("busybox", root.join("bin").join(applet))?;
    }
    let layout = work.join("layout");
    util::run(
        Command::new(oci)
            .args(["build", "--layout"])
            .arg(&layout)
            .args(["--ref", "v1", "--root"])
            .arg(&root)
            .args(["--entrypoint", "/bin/sh", "--compression", "gzip"])
            .stdout(Stdio::null()),
    )?;
    let out = Command::new(oci)
        .args(["push", "--plain-http", "--quiet"])
        .arg(format!("oci:{}:v1", layout.display()))
        .arg(format!("docker://{host}/bench/sh:v1"))
        .output()?;
    if !out.status.success() {
        bail!("oci push failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(format!(
        "{host}/bench/sh@{}",
        String::from_utf8_lossy(&out.stdout).trim()
    ))
}

/// Blob GETs in the registry's access log so far.
fn blob_gets(log: &Path) -> Result<usize> {
    let text = std::fs::read_to_string(log)?;
    Ok(text
        .lines()
        .filter(|l| l.contains("\"GET /v2/") && l.contains("/blobs/"))
        .count())
}

fn remove_containers(filter: &[&str; 2]) -> Result<()> {
    let out = Command::new("docker")
        .args([
            "ps",
            "-aq",
            "--filter",
            &format!("{}={}", filter[0], filter[1]),
        ])
        .output()?;
    let ids: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect();
    if !ids.is_empty() {
        Command::new("docker")
            .args(["rm", "-f"])
            .args(&ids)
            .stdout(Stdio::null())
            .status()?;
    }
    Ok(())
}
