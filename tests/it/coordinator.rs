//! Tests: coordinator. The serving coordinator under pressure from outside its protocol: operator
//! commands racing its start, connections that never say who they are, and an agent of another
//! version sending a run state this coordinator does not know.
use fleet_agent::identity::Identity;
use fleet_proto::joinfile::JoinFile;
use fleet_proto::protocol::{self, Down, Up};
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use testkit::agent::{Agent, Coordinator, script, wait_until};

const WAIT: Duration = Duration::from_secs(30);

#[test]
fn serve_starts_every_time_while_operator_commands_read_the_store_in_a_loop() {
    let dir = testkit::tempdir();
    let data = dir.path().join("coord");
    let mut coord = Coordinator::start(&data, &[]);
    coord.kill();
    let stop = Arc::new(AtomicBool::new(false));
    let (answered, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let reader = std::thread::spawn({
        let (stop, answered, failed, data) =
            (stop.clone(), answered.clone(), failed.clone(), data.clone());
        move || {
            while !stop.load(Ordering::Relaxed) {
                let out = testkit::cmd("fleet-coordinator")
                    .arg("--data")
                    .arg(&data)
                    .args(["nodes", "--json"])
                    .output()
                    .unwrap();
                let counter = if out.status.success() {
                    &answered
                } else {
                    &failed
                };
                counter.fetch_add(1, Ordering::Relaxed);
                if !out.status.success() {
                    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
                }
            }
        }
    });
    // At least 20 starts, and as many more as it takes for 20 reads to race them.
    let mut starts = 0;
    let raced = wait_until(Duration::from_secs(120), || {
        // `start` fails the test when serve exits instead of printing its address.
        coord.restart();
        starts += 1;
        // Pacing, not a wait: reads land on a serving coordinator too, not only on its starts.
        std::thread::sleep(Duration::from_millis(50));
        starts >= 20 && answered.load(Ordering::Relaxed) >= 20
    });
    stop.store(true, Ordering::Relaxed);
    reader.join().unwrap();
    let (answered, failed) = (
        answered.load(Ordering::Relaxed),
        failed.load(Ordering::Relaxed),
    );
    assert_eq!(
        failed, 0,
        "{answered} operator commands answered, {failed} failed"
    );
    assert!(raced, "only {answered} operator reads in {starts} starts");
    eprintln!("{starts} starts of serve, {answered} operator reads, none failed");
}

/// The coordinator's resident memory and its peak, in KiB.
fn memory_kib(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| -> u64 {
        let line = status.lines().find(|l| l.starts_with(name)).unwrap();
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// One connection that completes the TLS handshake with a key no node has, then sends the start
/// of a frame: either one claiming `claimed` bytes with 64 KiB behind it, or one just under the
/// limit sent halfway and held.
async fn unidentified(address: String, pinned: Vec<u8>, claimed: u32) -> Option<impl Send> {
    use tokio::io::AsyncWriteExt;
    let identity = Identity {
        key: rcgen::KeyPair::generate_for(&rcgen::PKCS_ED25519).unwrap(),
    };
    let mut dialed = fleet_agent::dial::dial(&address, &identity, &pinned, Duration::from_secs(60))
        .await
        .ok()?;
    let mut frame = claimed.to_be_bytes().to_vec();
    frame.extend(std::iter::repeat_n(
        b'x',
        (claimed as usize / 2).min(64 << 10),
    ));
    let _ = dialed.stream.write_all(&frame).await;
    let _ = dialed.stream.flush().await;
    Some(dialed.stream)
}

#[test]
fn a_thousand_unidentified_connections_hold_little_memory_and_a_node_still_works() {
    let dir = testkit::tempdir();
    let coord = Coordinator::start(&dir.path().join("coord"), &[]);
    let join_text = coord.token(&["--name", "healthy"]);
    let join: JoinFile = serde_json::from_str(&join_text).unwrap();
    std::fs::write(dir.path().join("fleet.json"), &join_text).unwrap();
    let agent = Agent::spawn(
        &dir.path().join("agent.log"),
        testkit::agent::machine_command(dir.path()),
    );
    assert!(
        agent.wait_for("session open", 1, WAIT),
        "{}",
        agent.log_text()
    );
    let (before, _) = memory_kib(coord.pid());

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let pinned = join.pinned_key();
    let held = runtime.block_on(async {
        let mut tasks = tokio::task::JoinSet::new();
        for n in 0..1000u32 {
            // Half claim a 16 MiB frame (the limit for an identified node), half one just under
            // the limit for a connection that has not proven its key, sent halfway and held.
            let claimed = if n % 2 == 0 { 16 << 20 } else { (16 << 10) - 1 };
            tasks.spawn(unidentified(join.address.clone(), pinned.clone(), claimed));
        }
        let mut held = Vec::new();
        while let Some(done) = tasks.join_next().await {
            held.extend(done.unwrap());
        }
        held
    });
    let (during, peak) = memory_kib(coord.pid());

    // While they are held, the joined node still takes a run and finishes it.
    let marks = dir.path().join("marks");
    let program = script(
        &dir.path().join("mark.sh"),
        &format!("echo ran >> {}", marks.display()),
    );
    let set = testkit::ok(
        coord
            .command()
            .args(["run", "--all", "--program"])
            .arg(&program),
    );
    let finished = wait_until(WAIT, || {
        let out = testkit::ok(
            coord
                .command()
                .args(["status", "--set", set.trim(), "--json"]),
        );
        let rows: Value = serde_json::from_str(&out).unwrap();
        rows[0]["state"] == "finished"
    });
    assert!(finished, "the healthy node's run did not finish");
    drop(held);
    drop(runtime);
    let grown = peak.saturating_sub(before);
    eprintln!(
        "coordinator RSS: {before} KiB before, {during} KiB with {} unidentified connections handshaken, peak {peak} KiB (+{grown} KiB)",
        1000
    );
    assert!(
        grown < 64 << 10,
        "1 000 unidentified connections cost {grown} KiB"
    );
    assert!(
        coord.log_text().contains("over the 16384 byte limit"),
        "{}",
        coord.log_text()
    );
}

#[test]
fn an_unknown_run_state_from_the_wire_is_refused_on_its_event_and_the_session_goes_on() {
    let dir = testkit::tempdir();
    let coord = Coordinator::start(&dir.path().join("coord"), &[]);
    let testkit::agent::HandNode {
        join,
        identity,
        runtime,
    } = testkit::agent::HandNode::new(dir.path(), &coord, "newer");
    let node_id = runtime
        .block_on(fleet_agent::join::join(
            &identity,
            &join,
            Duration::from_millis(50),
        ))
        .unwrap();
    // A run for this node, which this hand-driven "agent of a newer version" will report on.
    let program = script(&dir.path().join("p.sh"), "true");
    let set = testkit::ok(
        coord
            .command()
            .args(["run", "--node", node_id.as_str(), "--program"])
            .arg(&program),
    );
    let rows = status(&coord, set.trim());
    let run = rows[0]["run_id"].as_str().unwrap().to_string();
    runtime.block_on(async {
        let mut dialed =
            fleet_agent::dial::dial(&join.address, &identity, &join.pinned_key(), Duration::from_secs(60))
                .await
                .unwrap();
        let stream = &mut dialed.stream;
        protocol::write_msg(stream, &Up::Hello { node_id: node_id.clone() }).await.unwrap();
        let welcome: Down = protocol::read_msg(stream).await.unwrap().unwrap();
        assert!(matches!(welcome, Down::Welcome { .. }), "{welcome:?}");
        let event = |id: u64, state: &str| {
            json!({ "type": "event", "event": { "id": id, "run_id": run, "state": state, "at_unix_ms": 1 } })
        };
        protocol::write_msg(stream, &event(1, "paused")).await.unwrap();
        protocol::write_msg(stream, &event(2, "running")).await.unwrap();
        // Both are stored (the unknown one as refused), so the node may forget both.
        let deadline = Instant::now() + WAIT;
        loop {
            let msg: Down = protocol::read_msg(stream).await.unwrap().expect("the session stays open");
            if let Down::Ack { up_to: 2 } = msg {
                break;
            }
            assert!(Instant::now() < deadline, "no ack for both events");
        }
        // The session goes on: a heartbeat is still welcome.
        protocol::write_msg(stream, &Up::Heartbeat).await.unwrap();
    });
    let row = &status(&coord, set.trim())[0];
    assert_eq!(row["state"], "running", "{row:#}");
    assert_eq!(row["events"], json!([1, 2]), "{row:#}");
    assert_eq!(
        row["refused_events"],
        json!([{ "id": 1, "reason": "event 1 carries state \"paused\", which this coordinator cannot read (unknown variant `paused`, expected one of `waiting`, `starting`, `running`, `finished`, `failed`, `lost`); upgrade the coordinator to the agent's version" }]),
        "{row:#}"
    );
    assert!(
        coord.log_text().contains("refused an event"),
        "{}",
        coord.log_text()
    );
}

fn status(coord: &Coordinator, set: &str) -> Vec<Value> {
    let out = testkit::ok(coord.command().args(["status", "--set", set, "--json"]));
    serde_json::from_str(&out).unwrap()
}

#[test]
fn the_agent_links_no_coordinator_code() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap();
    let tree = testkit::ok(
        std::process::Command::new(env!("CARGO"))
            .current_dir(root)
            .args([
                "tree",
                "--offline",
                "-p",
                "fleet-agent",
                "-e",
                "normal",
                "--prefix",
                "none",
            ]),
    );
    assert!(tree.contains("fleet-proto"), "{tree}");
    for server_side in ["fleet-coordinator", "tokio-postgres", "sqlx"] {
        assert!(
            !tree.contains(server_side),
            "fleet-agent depends on {server_side}:\n{tree}"
        );
    }
}

/// `fleet-loadgen` with `count` simulated nodes joined through `coord`, each keeping a session.
fn simulated_nodes(
    coord: &Coordinator,
    dir: &std::path::Path,
    count: usize,
) -> std::process::Child {
    let joins = dir.join("joins.jsonl");
    let minted = coord.token(&["--count", &count.to_string(), "--ttl", "10m"]);
    std::fs::write(&joins, minted).unwrap();
    testkit::cmd("fleet-loadgen")
        .arg("--join-files")
        .arg(&joins)
        .args(["--duration", "10m"])
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(dir.join("loadgen.log")).unwrap())
        .spawn()
        .unwrap()
}

/// Waits until `count` nodes have opened a session.
fn sessions_open(coord: &Coordinator, count: usize) -> bool {
    wait_until(Duration::from_secs(120), || {
        let nodes = coord.nodes();
        nodes.len() == count && nodes.iter().all(|n| n["sessions"].as_u64() >= Some(1))
    })
}

#[test]
fn past_its_connection_cap_the_coordinator_serves_the_next_connection_once_one_closes() {
    use std::io::{Read, Write};
    let dir = testkit::tempdir();
    let flags = [
        "--max-connections",
        "2",
        "--heartbeat",
        "1s",
        "--lease",
        "30s",
    ];
    let coord = Coordinator::start(&dir.path().join("coord"), &flags);
    let mut nodes = simulated_nodes(&coord, dir.path(), 2);
    assert!(sessions_open(&coord, 2), "{}", coord.log_text());
    let full = "the connection cap of 2 is reached: new connections wait in the listen backlog until one closes; raise --max-connections (and the open-file limit) for more";
    assert!(
        wait_until(WAIT, || coord.log_text().contains(full)),
        "{}",
        coord.log_text()
    );
    // Two sessions hold both places: a bundle download waits in the backlog, unanswered.
    let mut waiting = std::net::TcpStream::connect(&coord.addr).unwrap();
    waiting
        .write_all(b"GET /bundles/hub-linux-x86_64.tar.gz HTTP/1.1\r\n\r\n")
        .unwrap();
    waiting
        .set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let mut first = [0u8; 1];
    let early = waiting.read(&mut first);
    assert!(
        early
            .as_ref()
            .is_err_and(|e| e.kind() == std::io::ErrorKind::WouldBlock),
        "answered while at the cap: {early:?}"
    );
    // The sessions go: the download is served.
    nodes.kill().unwrap();
    nodes.wait().unwrap();
    waiting
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut answer = String::new();
    waiting.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 404"), "{answer}");
}

#[test]
fn a_stopped_coordinator_ends_100_live_sessions_within_its_grace_and_cuts_none() {
    let dir = testkit::tempdir();
    let flags = [
        "--shutdown-grace",
        "30s",
        "--heartbeat",
        "1s",
        "--lease",
        "30s",
    ];
    let mut coord = Coordinator::start(&dir.path().join("coord"), &flags);
    let mut nodes = simulated_nodes(&coord, dir.path(), 100);
    assert!(sessions_open(&coord, 100), "{}", coord.log_text());
    let stopped_at = Instant::now();
    let term = testkit::output(
        std::process::Command::new("kill")
            .args(["-TERM", &coord.pid().to_string()])
            .stdin(std::process::Stdio::null()),
    );
    assert!(term.status.success());
    let exited = coord.wait_exit(Duration::from_secs(60));
    let took = stopped_at.elapsed();
    nodes.kill().unwrap();
    nodes.wait().unwrap();
    assert!(
        exited.is_some_and(|s| s.success()),
        "serve did not exit cleanly on SIGTERM: {exited:?}\n{}",
        coord.log_text()
    );
    let log = coord.log_text();
    assert!(
        log.contains("stopped serving: 100 of 100 connections ended within the grace, 0 cut"),
        "{log}"
    );
    eprintln!("100 sessions drained; serve exited {took:?} after SIGTERM");
}

/// A heartbeat at or above half the lease would lose a node between two beats by design:
/// `serve` refuses it in one line naming both, before it opens anything.
#[test]
fn a_heartbeat_at_half_the_lease_or_more_is_refused() {
    let dir = testkit::tempdir();
    let data = dir.path().join("coord");
    for (heartbeat, lease, said) in [
        (
            "10s",
            "20s",
            "--heartbeat 10 s is at or above half of --lease 20 s",
        ),
        (
            "30s",
            "20s",
            "--heartbeat 30 s is at or above half of --lease 20 s",
        ),
        (
            "1500ms",
            "3s",
            "--heartbeat 1500 ms is at or above half of --lease 3 s",
        ),
    ] {
        let err = testkit::fails(
            testkit::cmd("fleet-coordinator")
                .arg("--data")
                .arg(&data)
                .args([
                    "serve",
                    "--listen",
                    "127.0.0.1:0",
                    "--heartbeat",
                    heartbeat,
                    "--lease",
                    lease,
                ]),
        );
        let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{err}");
        assert!(lines[0].contains(said), "{err}");
        assert!(lines[0].ends_with("a node would be lost between two heartbeats; give --lease more than twice the heartbeat"), "{err}");
        assert!(
            !data.join(fleet_coordinator::STORE_FILE).exists(),
            "nothing opened"
        );
    }
    // Just under half is served.
    let _coord = Coordinator::start(&data, &["--heartbeat", "999ms", "--lease", "2s"]);
}
