//! Tests: hostile clients against a serving coordinator, as real processes. A source that sends
//! joins with wrong tokens is closed at accept once past its allowance (a burst of 10, then one a
//! second), with one line in the log, while a node's held session goes on and a good token from
//! elsewhere still joins; a panic in one connection's task (a test build's hook) is logged and
//! takes down that connection only. No timing targets: these hold on a busy machine too.
use fleet_proto::joinfile::{JoinFile, TOKEN_PREFIX};
use fleet_proto::protocol::{self, Down, Up};
use fleet_proto::{NodeId, pin};
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use testkit::agent::{Agent, Coordinator, machine_command, wait_until};

const WAIT: Duration = Duration::from_secs(60);
/// What the coordinator allows a source before it closes it at accept (`live/joins.rs`).
const BURST: usize = 10;
/// A source of wrong tokens, and another for the test's own tries; agents dial from 127.0.0.1.
const FLOODER: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));
const OTHER: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 3));

/// A well-formed token the coordinator never minted.
fn token_shaped(fill: char) -> String {
    format!("{TOKEN_PREFIX}{}", fill.to_string().repeat(43))
}

/// How one hand-driven join ended.
#[derive(Debug)]
enum Tried {
    /// Closed before the TLS handshake finished: refused at accept.
    RefusedAtAccept,
    /// Handshake done, join sent, closed without an answer.
    ClosedAfterJoin,
    Joined(NodeId),
}

/// One join with `token` from source address `from`, with a fresh node key, over the real
/// pinned TLS.
async fn try_join(join: &JoinFile, from: IpAddr, token: &str) -> Tried {
    let address: SocketAddr = join.address.parse().expect("the join file names ip:port");
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::new(from, 0)).unwrap();
    let tcp = tokio::time::timeout(WAIT, socket.connect(address))
        .await
        .expect("the connect does not hang")
        .expect("the coordinator's port takes connections");
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ED25519).unwrap();
    let cert = pin::mint_cert(&key, Duration::from_secs(300)).unwrap();
    let seen = Arc::new(Mutex::new(None));
    let config = pin::client_config(&key, cert, join.pinned_key(), seen).unwrap();
    let handshake = tokio_rustls::TlsConnector::from(config).connect(pin::server_name(), tcp);
    let mut tls = match tokio::time::timeout(WAIT, handshake).await {
        Ok(Ok(tls)) => tls,
        Ok(Err(_)) => return Tried::RefusedAtAccept,
        Err(_) => panic!("the TLS handshake from {from} neither finished nor failed"),
    };
    let request = Up::Join {
        token: fleet_proto::joinfile::Secret(token.to_string()),
        name: None,
        labels: Default::default(),
    };
    if protocol::write_msg(&mut tls, &request).await.is_err() {
        return Tried::ClosedAfterJoin;
    }
    match tokio::time::timeout(WAIT, protocol::read_msg::<_, Down>(&mut tls)).await {
        Ok(Ok(Some(Down::Joined { node_id, .. }))) => Tried::Joined(node_id),
        Ok(Ok(None)) | Ok(Err(_)) => Tried::ClosedAfterJoin,
        Ok(Ok(Some(other))) => panic!("a join was answered {other:?}"),
        Err(_) => panic!("a join from {from} was neither answered nor closed"),
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// A machine folder with a fresh join file named `name`; returns the folder.
fn machine(root: &Path, join_text: &str, name: &str) -> PathBuf {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("fleet.json"), join_text).unwrap();
    dir
}

fn start_agent(dir: &Path) -> Agent {
    let agent = Agent::spawn(&dir.join("agent.log"), machine_command(dir));
    assert!(
        agent.wait_for("session open", 1, WAIT),
        "{}",
        agent.log_text()
    );
    agent
}

/// The node row named `name`, from `fleet-coordinator nodes --json`.
fn row(nodes: &[Value], name: &str) -> Value {
    nodes
        .iter()
        .find(|n| n["name"] == name)
        .unwrap_or_else(|| panic!("no node named {name} in {nodes:#?}"))
        .clone()
}

/// The agent held its one session throughout: never lost, never opened again, and the
/// coordinator records heartbeats of it heard after `since_ms`.
fn held_throughout(agent: &Agent, nodes: impl Fn() -> Vec<Value>, name: &str, since_ms: u64) {
    let log = agent.log_text();
    assert!(!log.contains("session lost"), "{log}");
    assert_eq!(agent.count("session open"), 1, "{log}");
    let mut last = Value::Null;
    let fresh = wait_until(WAIT, || {
        last = row(&nodes(), name);
        last["last_heartbeat_ms"].as_u64().unwrap_or(0) > since_ms
    });
    assert!(fresh, "no heartbeat recorded after {since_ms}: {last:#}");
    assert_eq!(last["state"], "Joined", "{last:#}");
    assert_eq!(
        last["sessions"], 1,
        "one session, never opened again: {last:#}"
    );
}

#[test]
fn a_source_past_its_failed_joins_is_closed_at_accept_while_sessions_and_good_joins_go_on() {
    let dir = testkit::tempdir();
    let coord = Coordinator::start(
        &dir.path().join("coord"),
        &["--heartbeat", "500ms", "--lease", "10s"],
    );
    let held_text = coord.token(&["--name", "held"]);
    let join: JoinFile = serde_json::from_str(&held_text).unwrap();
    let held = start_agent(&machine(dir.path(), &held_text, "held"));
    let runtime = runtime();
    let wrong = token_shaped('0');

    // Wrong tokens from one source, one after another, until a connection is closed at accept.
    let began = Instant::now();
    let mut failed = 0;
    let refused_at = loop {
        match runtime.block_on(try_join(&join, FLOODER, &wrong)) {
            Tried::ClosedAfterJoin => failed += 1,
            Tried::RefusedAtAccept => break Instant::now(),
            Tried::Joined(id) => panic!("a wrong token joined as {id}"),
        }
        // The allowance refills one a second: that many more may get through on a slow machine.
        let allowed = BURST + began.elapsed().as_secs_f64().ceil() as usize;
        assert!(
            failed <= allowed,
            "{failed} wrong-token joins served in {:?}, none refused at accept",
            began.elapsed()
        );
    };
    assert!(
        failed >= BURST,
        "refused at accept after only {failed} failed joins"
    );
    // Its next connections are closed at accept too, but for what refills meanwhile.
    let more = 20;
    let admitted = (0..more)
        .filter(|_| {
            !matches!(
                runtime.block_on(try_join(&join, FLOODER, &wrong)),
                Tried::RefusedAtAccept
            )
        })
        .count();
    let refilled = refused_at.elapsed().as_secs_f64().ceil() as usize;
    assert!(
        admitted <= refilled,
        "{admitted} of {more} connections served within {:?} of the refusal",
        refused_at.elapsed()
    );

    // The line that says so, once: one a source every 10 s at most.
    let line = format!(
        "refusing connections from {FLOODER}: it sent more than {BURST} joins with wrong tokens"
    );
    assert!(
        wait_until(WAIT, || coord.log_text().contains(&line)),
        "{}",
        coord.log_text()
    );
    let lines = coord.log_text().matches(&line).count();
    let windows = 1 + refused_at.elapsed().as_secs() as usize / 10;
    assert!(
        lines >= 1 && lines <= windows,
        "{lines} refusing lines in {:?}:\n{}",
        refused_at.elapsed(),
        coord.log_text()
    );

    // A flood from the load generator, 8 more sources for 3 s: refused, never joined.
    let joins = dir.path().join("flood.jsonl");
    std::fs::write(
        &joins,
        format!("{}\n", serde_json::to_string(&join).unwrap()),
    )
    .unwrap();
    let flood = testkit::ok(
        testkit::cmd("fleet-loadgen")
            .args([
                "--flood",
                "--rate",
                "300",
                "--sources",
                "8",
                "--duration",
                "3s",
            ])
            .arg("--join-files")
            .arg(&joins),
    );
    let last: Value = serde_json::from_str(flood.lines().last().unwrap_or("{}")).unwrap();
    eprintln!("the flood's last counters: {last}");
    assert_eq!(last["joined"], 0, "{flood}");
    assert!(last["refused_at_accept"].as_u64() > Some(0), "{flood}");
    assert!(last["closed_after_join"].as_u64() >= Some(8), "{flood}");

    // A good token from another source still joins: a real agent from 127.0.0.1, and a
    // hand-driven node from 127.0.0.3.
    let fresh = start_agent(&machine(
        dir.path(),
        &coord.token(&["--name", "fresh"]),
        "fresh",
    ));
    let other: JoinFile = serde_json::from_str(&coord.token(&["--name", "other"])).unwrap();
    match runtime.block_on(try_join(&other, OTHER, &other.token.0)) {
        Tried::Joined(_) => {}
        tried => panic!("a good token from {OTHER} was {tried:?}"),
    }

    // The held node kept its session, heartbeats recorded after all of that.
    let flood_over = fleet_proto::clock::now_ms();
    held_throughout(&held, || coord.nodes(), "held", flood_over);
    assert!(
        fresh.wait_for("session open", 1, WAIT),
        "{}",
        fresh.log_text()
    );

    // Once its allowance refills the flooding source may try again: a good token from it joins.
    std::thread::sleep(Duration::from_millis(1500));
    let again: JoinFile = serde_json::from_str(&coord.token(&["--name", "again"])).unwrap();
    match runtime.block_on(try_join(&again, FLOODER, &again.token.0)) {
        Tried::Joined(_) => {}
        tried => panic!("after the refill, a good token from {FLOODER} was {tried:?}"),
    }
    let names: Vec<Value> = coord.nodes().iter().map(|n| n["name"].clone()).collect();
    assert_eq!(names.len(), 4, "held, fresh, other, again: {names:?}");
}

/// `fleet-coordinator serve` with a test build's panic hook armed: a join with `token` panics in
/// its task. Killed when dropped.
struct Armed {
    child: Child,
    data: PathBuf,
    log: PathBuf,
    addr: String,
}

impl Armed {
    fn start(data: &Path, token: &str) -> Armed {
        let log = data.with_extension("serve.log");
        let mut child = testkit::cmd("fleet-coordinator")
            .arg("--data")
            .arg(data)
            .args(["serve", "--listen", "127.0.0.1:0"])
            .args(["--heartbeat", "500ms", "--lease", "10s"])
            .args(["--metrics-listen", "127.0.0.1:0"])
            .env("FLEET_TEST_PANIC_ON_TOKEN", token)
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("can start the coordinator");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = (line.trim().strip_prefix("listening on "))
            .unwrap_or_else(|| panic!("serve printed {line:?}"))
            .to_string();
        Armed {
            child,
            data: data.to_path_buf(),
            log,
            addr,
        }
    }

    fn cli(&self, args: &[&str]) -> String {
        testkit::ok(
            testkit::cmd("fleet-coordinator")
                .arg("--data")
                .arg(&self.data)
                .args(args),
        )
    }

    fn nodes(&self) -> Vec<Value> {
        serde_json::from_str(&self.cli(&["nodes", "--json"])).unwrap()
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Armed {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn a_panic_in_one_connections_task_is_logged_and_every_other_connection_is_served_on() {
    let dir = testkit::tempdir();
    let panic_token = token_shaped('p');
    let mut coord = Armed::start(&dir.path().join("coord"), &panic_token);
    let held_text = coord.cli(&["token", "--name", "held"]);
    let join: JoinFile = serde_json::from_str(&held_text).unwrap();
    assert_eq!(join.address, coord.addr);
    let held = start_agent(&machine(dir.path(), &held_text, "held"));

    // The join that panics: its connection closes without an answer, and the panic is logged
    // as it happens, before any other connection comes.
    let tried = runtime().block_on(try_join(&join, OTHER, &panic_token));
    assert!(matches!(tried, Tried::ClosedAfterJoin), "{tried:?}");
    let said = "a connection's task panicked (the test hook FLEET_TEST_PANIC_ON_TOKEN asked for a panic in a join): that connection is closed, every other one is served on; report this as a bug";
    assert!(
        wait_until(WAIT, || coord.log_text().contains(said)),
        "{}",
        coord.log_text()
    );

    // The coordinator serves on: a new agent joins, the CLI answers through the serving process.
    let after = start_agent(&machine(
        dir.path(),
        &coord.cli(&["token", "--name", "after"]),
        "after",
    ));
    assert_eq!(coord.log_text().matches(said).count(), 1);
    assert!(
        coord.child.try_wait().unwrap().is_none(),
        "the coordinator exited"
    );
    let since = fleet_proto::clock::now_ms();
    held_throughout(&held, || coord.nodes(), "held", since);
    assert_eq!(row(&coord.nodes(), "after")["state"], "Joined");
    assert!(after.wait_for("session open", 1, WAIT));
    assert_eq!(coord.nodes().len(), 2, "{:#?}", coord.nodes());
}
