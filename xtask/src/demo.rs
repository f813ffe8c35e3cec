//! `cargo xtask demo`: the main job end to end on the embedded default, on loopback: a
//! coordinator, a join file, an agent that joins by itself, two runs (one timing out), their
//! status rows, a collected file with its digest, and where everything lives.
use crate::{cross, util};
use anyhow::{Context, Result, bail};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub fn run() -> Result<()> {
    let started = Instant::now();
    util::run(Command::new("cargo").args([
        "build",
        "--quiet",
        "-p",
        "fleet-agent",
        "-p",
        "fleet-run-supervisor",
    ]))?;
    let bin = cross::target_dir().join("debug/fleet-agent");
    let work = cross::target_dir().join("demo");
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work)?;
    let data = work.join("coordinator");
    let machine = work.join("machine");
    std::fs::create_dir_all(&machine)?;

    step(
        "1. start a coordinator (redb store, own key pair, one port for joins, sessions and bundles)",
    );
    let mut serve = Command::new(&bin)
        .args(["coordinator", "--data"])
        .arg(&data)
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--heartbeat",
            "500ms",
            "--lease",
            "3s",
        ])
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(work.join("coordinator.log"))?)
        .spawn()
        .context("cannot start the coordinator")?;
    let stdout = serve.stdout.take().expect("piped");
    let _serve = Proc(serve);
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line)?;
    let addr = line.trim().trim_start_matches("listening on ").to_string();
    println!("   coordinator on {addr}");

    step("2. mint a one-time join file (the store keeps only the token's hash)");
    let join = machine.join("fleet.json");
    let out = Command::new(&bin)
        .args(["coordinator", "--data"])
        .arg(&data)
        .args([
            "token",
            "--ttl",
            "10m",
            "--name",
            "demo-machine",
            "--label",
            "pool=demo",
        ])
        .output()?;
    if !out.status.success() {
        bail!(
            "coordinator token failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    std::fs::write(&join, &out.stdout)?;
    println!("   {}", join.display());

    step(
        "3. start an agent with it (it makes its key, joins over pinned TLS, deletes the join file)",
    );
    let agent_log = machine.join("agent.log");
    let agent = Command::new(&bin)
        .args(["--head-less", "--join-file"])
        .arg(&join)
        .arg("--state")
        .arg(machine.join("state"))
        .arg("--run-store")
        .arg(machine.join("runs"))
        .arg("--cloud-root")
        .arg(machine.join("cloud"))
        .args(["--accelerator-tool", "/nonexistent/nvidia-smi"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&agent_log)?)
        .spawn()
        .context("cannot start the agent")?;
    let _agent = Proc(agent);
    wait_for(&agent_log, "session open", Duration::from_secs(20))?;
    println!("   join file still there: {}", join.exists());

    step("4. the coordinator lists the node as Joined, with its facts");
    std::thread::sleep(Duration::from_millis(700));
    print!("{}", coordinator(&bin, &data, &["nodes"])?);

    step("5. stage a small program and run it with arguments and a timeout");
    let hello = program(
        &work.join("hello.sh"),
        "printf 'hello from %s: %s\\n' \"$(uname -n)\" \"$*\" | tee greeting.txt",
    )?;
    let set1 = run_set(
        &bin,
        &data,
        &hello,
        &["--timeout", "30s", "--", "fleet", "demo"],
    )?;
    println!("   set {set1}");

    step("6. run a second program that times out (sleep 60 with --timeout 1s)");
    let sleepy = program(&work.join("sleepy.sh"), "sleep 60")?;
    let set2 = run_set(&bin, &data, &sleepy, &["--timeout", "1s"])?;
    println!("   set {set2}");

    step("7. both status rows (polled until final)");
    print!(
        "{}",
        coordinator(&bin, &data, &["status", "--set", &set1, "--poll"])?
    );
    print!(
        "{}",
        coordinator(&bin, &data, &["status", "--set", &set2, "--poll"])?
    );

    step("8. collect a file from the first run, with its digest");
    let rows: serde_json::Value = serde_json::from_str(&coordinator(
        &bin,
        &data,
        &["status", "--set", &set1, "--json"],
    )?)?;
    let run = rows[0]["run_id"].as_str().unwrap_or_default().to_string();
    let out = work.join("greeting.txt");
    let digest = coordinator(
        &bin,
        &data,
        &[
            "collect",
            "--run",
            &run,
            "--path",
            "greeting.txt",
            "--out",
            &out.to_string_lossy(),
        ],
    )?;
    println!("   {} {}", digest.trim(), out.display());
    print!("   {}", std::fs::read_to_string(&out)?);

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

/// Runs `fleet-agent coordinator --data DATA ARGS` and returns its stdout.
fn coordinator(bin: &Path, data: &Path, args: &[&str]) -> Result<String> {
    let out = Command::new(bin)
        .args(["coordinator", "--data"])
        .arg(data)
        .args(args)
        .output()?;
    if !out.status.success() {
        bail!(
            "coordinator {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn run_set(bin: &Path, data: &Path, program: &Path, rest: &[&str]) -> Result<String> {
    let mut args = vec!["run", "--all", "--program"];
    let program = program.to_string_lossy();
    args.push(&program);
    args.extend_from_slice(rest);
    Ok(coordinator(bin, data, &args)?.trim().to_string())
}

fn program(path: &Path, body: &str) -> Result<std::path::PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, format!("#!/bin/sh\n{body}\n"))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))?;
    Ok(path.to_path_buf())
}

fn step(text: &str) {
    println!("\n== {text}");
}

fn wait_for(log: &Path, needle: &str, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if std::fs::read_to_string(log)
            .unwrap_or_default()
            .contains(needle)
        {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    bail!(
        "no `{needle}` in {} after {} s",
        log.display(),
        timeout.as_secs()
    )
}

/// A child process killed when the demo ends, however it ends.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
