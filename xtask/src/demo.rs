//! `cargo xtask demo`: the main job end to end on the embedded default, on loopback: a
//! coordinator, a join file, an agent that joins by itself, two runs (one timing out), their
//! status rows, a collected file with its digest, a reproducible image of a sample folder, an
//! image run as a container when a Docker engine is present (skipped, saying so, when not), and
//! where everything lives.
use crate::fleet::{self, Coordinator, Proc, script};
use crate::util;
use anyhow::{Result, bail};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub fn run() -> Result<()> {
    let started = Instant::now();
    let bin = fleet::build_debug()?;
    let work = fleet::fresh_dir("demo")?;
    let data = work.join("coordinator");
    let machine = work.join("machine");
    std::fs::create_dir_all(&machine)?;

    step(
        "1. start a coordinator (redb store, own key pair, one port for joins, sessions and bundles)",
    );
    let serve = Coordinator::serve(
        &bin,
        &data,
        &["--heartbeat", "500ms", "--lease", "3s"],
        std::fs::File::create(work.join("coordinator.log"))?.into(),
    )?;
    println!("   coordinator on {}", serve.addr);

    step("2. mint a one-time join file (the store keeps only the token's hash)");
    let join = machine.join("fleet.json");
    let token = serve.cli(&[
        "token",
        "--ttl",
        "10m",
        "--name",
        "demo-machine",
        "--label",
        "pool=demo",
    ])?;
    std::fs::write(&join, token)?;
    println!("   {}", join.display());

    step(
        "3. start an agent with it (it makes its key, joins over pinned TLS, deletes the join file)",
    );
    let agent_log = machine.join("agent.log");
    let _agent = Proc::spawn(
        fleet::agent(&bin, &join, &machine)
            .arg("--head-less")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&agent_log)?),
    )?;
    fleet::wait_for_log(&agent_log, "session open", Duration::from_secs(20))?;
    println!("   join file still there: {}", join.exists());

    step("4. the coordinator lists the node as Joined, with its facts");
    std::thread::sleep(Duration::from_millis(700));
    print!("{}", serve.cli(&["nodes"])?);

    step("5. stage a small program and run it with arguments and a timeout");
    let hello = script(
        &work.join("hello.sh"),
        "printf 'hello from %s: %s\\n' \"$(uname -n)\" \"$*\" | tee greeting.txt",
    )?;
    let set1 = serve.run_set(&hello, &["--timeout", "30s", "--", "fleet", "demo"])?;
    println!("   set {set1}");

    step("6. run a second program that times out (sleep 60 with --timeout 1s)");
    let sleepy = script(&work.join("sleepy.sh"), "sleep 60")?;
    let set2 = serve.run_set(&sleepy, &["--timeout", "1s"])?;
    println!("   set {set2}");

    step("7. both status rows (polled until final)");
    print!("{}", serve.cli(&["status", "--set", &set1, "--poll"])?);
    print!("{}", serve.cli(&["status", "--set", &set2, "--poll"])?);

    step("8. collect a file from the first run, with its digest");
    collect_greeting(&serve, &set1, &work.join("greeting.txt"))?;

    step("9. build the sample folder into an OCI image (same files, same digest) and inspect it");
    let layout = work.join("image");
    let oci = bin.with_file_name("oci");
    let build = |reference: &str| -> Result<String> {
        let out = Command::new(&oci)
            .arg("build")
            .arg("--layout")
            .arg(&layout)
            .args(["--ref", reference, "--root"])
            .arg(util::root().join("examples/sample-app"))
            .args(["--entrypoint", "/bin/hello"])
            .output()?;
        if !out.status.success() {
            bail!(
                "oci build failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    };
    let (first, second) = (build("sample")?, build("sample-again")?);
    println!(
        "   built twice: {first} and {second} (equal: {})",
        first == second
    );
    let inspected = Command::new(&oci)
        .arg("inspect")
        .arg(format!("oci:{}:sample", layout.display()))
        .output()?;
    print!("{}", String::from_utf8_lossy(&inspected.stdout));

    step("10. run an image by digest as a container on the agent's Docker engine");
    let reached = std::fs::read_to_string(&agent_log)?.contains("Docker engine reached");
    if !reached || !util::have("docker-registry") || !std::path::Path::new("/bin/busybox").exists()
    {
        println!(
            "   skipped: this step needs a Docker engine the agent reaches (its log says whether it did), docker-registry and busybox-static"
        );
    } else {
        let registry = crate::bench::registry::Registry::start(&work, "registry")?;
        let image = crate::bench::container::busybox_image(&oci, &work, &registry.host)?;
        println!("   pushed {image}");
        let set3 = serve.cli(&[
            "run",
            "--all",
            "--image",
            &image,
            "--",
            "-c",
            "echo hello from a container > greeting.txt",
        ])?;
        print!(
            "{}",
            serve.cli(&["status", "--set", set3.trim(), "--poll"])?
        );
        let run = collect_greeting(&serve, set3.trim(), &work.join("container-greeting.txt"))?;
        println!("   the container: octomy-run-{run} (kept with the newest 1 000 finished runs)");
    }

    step("where everything lives");
    for (what, path) in [
        (
            "coordinator data (key, redb store, operator socket)",
            data.clone(),
        ),
        ("coordinator log", work.join("coordinator.log")),
        (
            "agent state (node key 0600, membership)",
            machine.join("state"),
        ),
        ("agent log", agent_log),
        ("the sample image (OCI layout)", layout.clone()),
        (
            "run store (programs by digest, one folder per run)",
            machine.join("runs"),
        ),
        (
            "the agent's durable store (ops, event spool, runs)",
            machine.join("state/agent.redb"),
        ),
    ] {
        println!("   {what:<52} {}", path.display());
    }
    println!(
        "\ndemo finished in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

fn step(text: &str) {
    println!("\n== {text}");
}

/// Collects `greeting.txt` from the first run of `set` into `out`, prints its digest and text,
/// and returns the run's id.
fn collect_greeting(serve: &Coordinator, set: &str, out: &Path) -> Result<String> {
    let rows: serde_json::Value =
        serde_json::from_str(&serve.cli(&["status", "--set", set, "--json"])?)?;
    let run = rows[0]["run_id"].as_str().unwrap_or_default().to_string();
    let digest = serve.cli(&[
        "collect",
        "--run",
        &run,
        "--path",
        "greeting.txt",
        "--out",
        &out.to_string_lossy(),
    ])?;
    println!("   {} {}", digest.trim(), out.display());
    print!("   {}", std::fs::read_to_string(out)?);
    Ok(run)
}
