//! Tests: agent_join. A machine joins by itself: real coordinator and agent processes on
//! loopback, a proxy that loses answers, stand-in GPU tools, and every bad input.
use serde_json::Value;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;
use testkit::agent::{
    Agent, Coordinator, DroppingProxy, any_file_contains, stand_in_four_gpus, wait_until,
};

const WAIT: Duration = Duration::from_secs(20);

/// One machine's folders inside a test's temporary directory.
struct Machine {
    root: PathBuf,
}

impl Machine {
    fn new(dir: &Path, name: &str) -> Machine {
        let root = dir.join(name);
        std::fs::create_dir_all(&root).unwrap();
        Machine { root }
    }
    fn join_file(&self) -> PathBuf {
        self.root.join("fleet.json")
    }
    fn state(&self) -> PathBuf {
        self.root.join("state")
    }
    fn cloud(&self) -> PathBuf {
        self.root.join("cloud")
    }
    fn log(&self) -> PathBuf {
        self.root.join("agent.log")
    }
    /// `fleet-agent --head-less --join-file ... --state ...` with the test's folders, plus `extra`.
    fn start(&self, extra: &[&str]) -> Agent {
        Agent::start(&self.log(), self.args(extra))
    }
    /// The agent's arguments with the test's folders, plus `extra`.
    fn args(&self, extra: &[&str]) -> Vec<OsString> {
        let mut args: Vec<OsString> = vec![
            "--head-less".into(),
            "--join-file".into(),
            self.join_file().into(),
            "--state".into(),
            self.state().into(),
            "--cloud-root".into(),
            self.cloud().into(),
            "--run-store".into(),
            self.root.join("runs").into(),
            "--retry-base".into(),
            "100ms".into(),
        ];
        if !extra.contains(&"--accelerator-tool") {
            args.extend([
                "--accelerator-tool".into(),
                "/nonexistent/nvidia-smi".into(),
            ]);
        }
        args.extend(extra.iter().map(OsString::from));
        args
    }
    /// Runs the agent to its exit and returns its last stderr line.
    fn fails_with(&self, extra: &[&str]) -> String {
        let mut agent = self.start(extra);
        let status = agent.wait_exit(WAIT).expect("the agent exits on bad input");
        assert_eq!(status.code(), Some(1), "log: {}", agent.log_text());
        agent
            .log_text()
            .lines()
            .last()
            .unwrap_or_default()
            .to_string()
    }
}

fn token_of(join: &str) -> String {
    let v: Value = serde_json::from_str(join).unwrap();
    v["token"].as_str().unwrap().to_string()
}

fn edit_join(join: &str, change: impl FnOnce(&mut serde_json::Map<String, Value>)) -> String {
    let mut v: Value = serde_json::from_str(join).unwrap();
    change(v.as_object_mut().unwrap());
    v.to_string()
}

#[test]
fn happy_path_joins_reports_facts_and_forgets_every_secret() {
    let dir = testkit::tempdir();
    let coord = Coordinator::start(&dir.path().join("coord"), &[]);
    let m = Machine::new(dir.path(), "m1");
    let join = coord.token(&["--name", "gpu-box", "--label", "zone=test"]);
    let token = token_of(&join);
    std::fs::write(m.join_file(), &join).unwrap();
    // cloud-init's copies of the user data that carried the token
    for folder in ["instance", "instances/i-0abc"] {
        let f = m.cloud().join(folder);
        std::fs::create_dir_all(f.join("scripts")).unwrap();
        std::fs::write(f.join("user-data.txt"), &join).unwrap();
        std::fs::write(f.join("user-data.txt.i"), &join).unwrap();
        std::fs::write(f.join("scripts/part-001"), &join).unwrap();
        std::fs::write(f.join("vendor-data.txt"), "kept").unwrap();
    }
    let tool = stand_in_four_gpus(&m.root);
    let agent = m.start(&[
        "--accelerator-tool",
        tool.to_str().unwrap(),
        "--log-format",
        "json",
    ]);
    assert!(
        agent.wait_for("\"Joined\"", 1, WAIT),
        "log: {}",
        agent.log_text()
    );

    assert!(wait_until(WAIT, || coord
        .nodes()
        .first()
        .is_some_and(|n| n["facts"].is_object())));
    let nodes = coord.nodes();
    assert_eq!(nodes.len(), 1);
    let node = &nodes[0];
    assert_eq!(node["state"], "Joined");
    assert_eq!(node["name"], "gpu-box");
    assert_eq!(node["labels"]["zone"], "test");
    assert!(node["public_key"].as_str().unwrap().starts_with("ed25519:"));
    let facts = &node["facts"];
    assert_eq!(facts["arch"], std::env::consts::ARCH);
    assert!(facts["cpus"].as_u64().unwrap() >= 1);
    assert!(facts["memory_bytes"].as_u64().unwrap() > 0);
    assert!(facts["disk_free_bytes"].as_u64().unwrap() > 0);
    assert!(!facts["kernel"].as_str().unwrap().is_empty());
    assert!(
        facts["os"].as_str().unwrap().contains("Debian")
            || !facts["os"].as_str().unwrap().is_empty()
    );
    let gpus = facts["accelerators"].as_array().unwrap();
    assert_eq!(gpus.len(), 4, "the stand-in tool prints four GPUs");
    assert_eq!(gpus[3]["index"], 3);
    assert_eq!(gpus[0]["name"], "NVIDIA H100 80GB HBM3");
    assert_eq!(gpus[0]["memory_mib"], 81559);
    assert_eq!(gpus[0]["driver"], "550.54.15");
    assert!(wait_until(WAIT, || coord.nodes()[0]["last_heartbeat_ms"].is_u64()));

    // Secrets: the join file and cloud-init's copies are gone, the rest stays.
    assert!(!m.join_file().exists());
    for folder in ["instance", "instances/i-0abc"] {
        let f = m.cloud().join(folder);
        assert!(!f.join("user-data.txt").exists());
        assert!(!f.join("user-data.txt.i").exists());
        assert!(!f.join("scripts").exists());
        assert!(f.join("vendor-data.txt").exists());
    }
    // The token is nowhere under the state dir or in the logs; the store holds only its hash.
    assert_eq!(any_file_contains(&m.state(), &token), None);
    assert!(!agent.log_text().contains(&token));
    assert!(!coord.log_text().contains(&token));
    let store = std::fs::read(coord.data.join("coordinator.redb")).unwrap();
    let contains = |needle: &[u8]| store.windows(needle.len()).any(|w| w == needle);
    assert!(
        !contains(token.as_bytes()),
        "the coordinator store holds the token itself"
    );
    let hash = sha256_hex(&token);
    assert!(
        contains(hash.as_bytes()),
        "the coordinator store holds the token's hash"
    );
    // The private key is private.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(m.state().join("node.key"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    // JSON logs are JSON, one object per line.
    for line in agent.log_text().lines() {
        serde_json::from_str::<Value>(line).unwrap_or_else(|e| panic!("not JSON: {line}: {e}"));
    }
}

/// The hash oracle is the system's sha256sum, not our code.
fn sha256_hex(text: &str) -> String {
    use std::io::Write;
    let mut child = std::process::Command::new("sha256sum")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    String::from_utf8(out.stdout).unwrap()[..64].to_string()
}

#[test]
fn token_reused_by_another_key_gets_no_answer() {
    let dir = testkit::tempdir();
    let coord = Coordinator::start(&dir.path().join("coord"), &[]);
    let join = coord.token(&[]);
    let (a, b) = (Machine::new(dir.path(), "a"), Machine::new(dir.path(), "b"));
    std::fs::write(a.join_file(), &join).unwrap();
    std::fs::write(b.join_file(), &join).unwrap();
    let first = a.start(&[]);
    assert!(
        first.wait_for("Joined", 1, WAIT),
        "log: {}",
        first.log_text()
    );
    let second = b.start(&[]);
    assert!(
        second.wait_for("no answer from the coordinator", 2, WAIT),
        "log: {}",
        second.log_text()
    );
    assert_eq!(second.count("Joined"), 0);
    assert!(
        b.join_file().exists(),
        "an agent that did not join keeps its join file"
    );
    assert_eq!(coord.nodes().len(), 1);
}

#[test]
fn expired_token_gets_no_answer_and_the_agent_gives_up() {
    let dir = testkit::tempdir();
    let coord = Coordinator::start(&dir.path().join("coord"), &[]);
    let join = coord.token(&["--ttl", "300ms"]);
    // Outlives the token's lifetime: the time passing is what is tested, not a wait.
    std::thread::sleep(Duration::from_millis(400));
    // Without its lifetime the agent still tries: the coordinator only closes the connection.
    let m = Machine::new(dir.path(), "m");
    std::fs::write(
        m.join_file(),
        edit_join(&join, |j| {
            j.remove("expires_at_ms");
            j.remove("ttl_ms");
        }),
    )
    .unwrap();
    let agent = m.start(&[]);
    assert!(
        agent.wait_for("no answer from the coordinator", 2, WAIT),
        "log: {}",
        agent.log_text()
    );
    drop(agent);
    assert!(coord.nodes().is_empty());
    assert!(
        coord
            .log_text()
            .contains("a join with an unknown, expired or already spent token")
    );
    // With it, the agent gives up once the token's lifetime has passed on its own clock, with
    // one clear line instead of retrying forever; its clock reading the token as expired is
    // only a warning, since the coordinator judges expiry.
    std::fs::write(m.join_file(), &join).unwrap();
    let last = m.fails_with(&[]);
    assert_eq!(
        last,
        "fleet-agent: the coordinator did not accept the join token in the 300 ms it was minted for (it is spent, expired or unknown to it): mint a new join file with `fleet-coordinator token`"
    );
}

#[test]
fn response_dropped_twice_still_ends_joined() {
    let dir = testkit::tempdir();
    let coord = Coordinator::start(&dir.path().join("coord"), &[]);
    let proxy = DroppingProxy::start(&coord.addr, 2);
    let join = coord.token(&[]);
    let m = Machine::new(dir.path(), "m");
    std::fs::write(
        m.join_file(),
        edit_join(&join, |j| {
            drop(j.insert("address".into(), proxy.addr.clone().into()))
        }),
    )
    .unwrap();
    let agent = m.start(&[]);
    assert!(
        agent.wait_for("Joined", 1, WAIT),
        "log: {}",
        agent.log_text()
    );
    assert_eq!(proxy.dropped.load(std::sync::atomic::Ordering::SeqCst), 2);
    assert_eq!(agent.count("no answer from the coordinator"), 2);
    assert_eq!(
        coord.log_text().matches("node joined").count(),
        1,
        "the token was spent once, answered three times"
    );
    let nodes = coord.nodes();
    assert_eq!(nodes.len(), 1);
    assert!(wait_until(WAIT, || coord.nodes()[0]["state"] == "Joined"));
}

#[test]
fn wrong_pinned_key_is_refused_with_a_clear_message() {
    let dir = testkit::tempdir();
    let coord = Coordinator::start(&dir.path().join("coord"), &[]);
    let other = Coordinator::start(&dir.path().join("other"), &[]);
    let join = coord.token(&[]);
    let other_key =
        serde_json::from_str::<Value>(&other.token(&[])).unwrap()["coordinator_key"].clone();
    let right_key = serde_json::from_str::<Value>(&join).unwrap()["coordinator_key"].clone();
    let m = Machine::new(dir.path(), "m");
    std::fs::write(
        m.join_file(),
        edit_join(&join, |j| {
            drop(j.insert("coordinator_key".into(), other_key.clone()))
        }),
    )
    .unwrap();
    let last = m.fails_with(&[]);
    assert_eq!(
        last,
        format!(
            "fleet-agent: the coordinator at {} presented key {}, but this node pins {}: refusing to talk to it (check the join file's coordinator_key)",
            coord.addr,
            right_key.as_str().unwrap(),
            other_key.as_str().unwrap()
        )
    );
    assert!(coord.nodes().is_empty());
    assert!(m.join_file().exists());
}

#[test]
fn coordinator_restart_and_agent_restart_resume_without_rejoin() {
    let dir = testkit::tempdir();
    let mut coord = Coordinator::start(&dir.path().join("coord"), &[]);
    let m = Machine::new(dir.path(), "m");
    std::fs::write(m.join_file(), coord.token(&[])).unwrap();
    let mut agent = m.start(&[]);
    assert!(
        agent.wait_for("session open", 1, WAIT),
        "log: {}",
        agent.log_text()
    );
    let id = coord.nodes()[0]["id"].clone();

    coord.restart();
    assert!(agent.wait_for("session lost", 1, WAIT));
    assert!(
        agent.wait_for("session open", 2, WAIT),
        "log: {}",
        agent.log_text()
    );
    assert_eq!(
        agent.count("joining"),
        1,
        "no second join after a coordinator restart"
    );
    let nodes = coord.nodes();
    assert_eq!((nodes.len(), &nodes[0]["id"]), (1, &id));
    assert!(wait_until(WAIT, || coord.nodes()[0]["state"] == "Joined"));

    agent.kill();
    let agent = m.start(&[]);
    assert!(
        agent.wait_for("session open", 1, WAIT),
        "log: {}",
        agent.log_text()
    );
    assert!(
        agent
            .log_text()
            .contains("resuming the membership; no join needed")
    );
    assert_eq!(agent.count("joining"), 0);
    assert_eq!(coord.nodes()[0]["id"], id);
    // Facts without the accelerator tool say none, without a crash.
    assert_eq!(
        coord.nodes()[0]["facts"]["accelerators"],
        serde_json::json!([])
    );
}

#[test]
fn session_credentials_are_renewed_and_a_silent_node_is_lost_after_the_lease() {
    let dir = testkit::tempdir();
    let coord = Coordinator::start(&dir.path().join("coord"), &[]);
    let m = Machine::new(dir.path(), "m");
    std::fs::write(m.join_file(), coord.token(&[])).unwrap();
    let mut agent = m.start(&["--session-validity", "1500ms"]);
    // Renewed at two thirds of the validity, before the coordinator would cut it.
    assert!(
        agent.wait_for("session credential renewed", 2, WAIT),
        "log: {}",
        agent.log_text()
    );
    assert_eq!(agent.count("session lost"), 0, "log: {}", agent.log_text());
    assert!(!coord.log_text().contains("lapsed"));
    assert!(wait_until(WAIT, || coord.nodes()[0]["state"] == "Joined"));
    agent.kill();
    assert!(wait_until(WAIT, || coord.nodes()[0]["state"] == "lost"));
}

#[test]
fn a_session_credential_longer_than_allowed_is_refused() {
    let dir = testkit::tempdir();
    let coord = Coordinator::start(&dir.path().join("coord"), &["--max-session-validity", "1m"]);
    let m = Machine::new(dir.path(), "m");
    std::fs::write(m.join_file(), coord.token(&[])).unwrap();
    let agent = m.start(&["--session-validity", "1h"]);
    assert!(
        agent.wait_for("session lost: the coordinator closed the session (it does not know this node, or its credential lapsed)", 2, WAIT),
        "log: {}",
        agent.log_text()
    );
    assert_eq!(agent.count("session open"), 0);
    assert!(
        coord
            .log_text()
            .contains("valid for longer than the allowed 60 s")
    );
}

#[test]
fn bundles_are_served_only_while_a_machine_waits_to_join() {
    let dir = testkit::tempdir();
    let data = dir.path().join("coord");
    std::fs::create_dir_all(data.join("bundles")).unwrap();
    let bundle = data.join("bundles/hub-linux-x86_64.tar.gz");
    std::fs::write(&bundle, b"not really a tarball, but bytes to fetch").unwrap();
    let coord = Coordinator::start(&data, &[]);
    let url = |suffix: &str| {
        format!(
            "http://{}/bundles/hub-linux-x86_64.tar.gz{suffix}",
            coord.addr
        )
    };
    let status = |u: &str| {
        testkit::ok(std::process::Command::new("curl").args([
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            u,
        ]))
    };
    assert_eq!(status(&url("")), "404", "no machine is waiting yet");

    let join = coord.token(&[]);
    let out = dir.path().join("got.tar.gz");
    testkit::ok(
        std::process::Command::new("curl")
            .args(["-fsS", "-o"])
            .arg(&out)
            .arg(url("")),
    );
    assert_eq!(
        std::fs::read(&out).unwrap(),
        std::fs::read(&bundle).unwrap()
    );
    let sum = testkit::ok(std::process::Command::new("curl").args(["-fsS", &url(".sha256")]));
    let oracle = testkit::ok(std::process::Command::new("sha256sum").arg(&bundle));
    assert_eq!(
        sum.split_whitespace().next(),
        oracle.split_whitespace().next()
    );
    assert_eq!(
        status(&format!(
            "http://{}/bundles/hub-linux-riscv.tar.gz",
            coord.addr
        )),
        "404"
    );

    let m = Machine::new(dir.path(), "m");
    std::fs::write(m.join_file(), join).unwrap();
    let agent = m.start(&[]);
    assert!(agent.wait_for("Joined", 1, WAIT));
    assert_eq!(status(&url("")), "404", "nobody waits any more");
}

#[test]
fn user_data_writes_the_join_file_and_starts_the_agent() {
    let dir = testkit::tempdir();
    let data = dir.path().join("coord");
    std::fs::create_dir_all(data.join("bundles")).unwrap();
    std::fs::write(data.join("bundles/hub-linux-arm64.tar.gz"), b"arm bundle").unwrap();
    let coord = Coordinator::start(&data, &[]);
    let text =
        testkit::ok(
            coord
                .command()
                .args(["user-data", "--arch", "arm64", "--name", "arm-1"]),
        );
    assert!(text.starts_with("#cloud-config\n"));
    // Parsed by an independent YAML reader, the way cloud-init would.
    let parsed = testkit::ok(
        std::process::Command::new("python3")
            .args([
                "-c",
                "import sys, yaml, json; print(json.dumps(yaml.safe_load(sys.stdin.read())))",
            ])
            .stdin(std::fs::File::open(write(dir.path(), "ud.yaml", &text)).unwrap()),
    );
    let doc: Value = serde_json::from_str(&parsed).unwrap();
    let file = &doc["write_files"][0];
    assert_eq!(file["path"], "/run/octomy/fleet.json");
    assert_eq!(file["permissions"], "0600");
    let join: Value = serde_json::from_str(file["content"].as_str().unwrap()).unwrap();
    let sum = testkit::ok(
        std::process::Command::new("sha256sum").arg(data.join("bundles/hub-linux-arm64.tar.gz")),
    );
    assert_eq!(
        join["bundle_sha256"].as_str(),
        sum.split_whitespace().next()
    );
    assert_eq!(join["name"], "arm-1");
    let script = doc["runcmd"][0][2].as_str().unwrap();
    assert!(script.contains(&format!(
        "http://{}/bundles/hub-linux-arm64.tar.gz",
        coord.addr
    )));
    assert!(script.contains("sha256sum \"$bundle\""));
    assert!(script.contains("systemctl enable --now fleet-agent.service"));
    let unit = &doc["write_files"][1];
    assert_eq!(unit["path"], "/etc/systemd/system/fleet-agent.service");
    assert!(unit["content"].as_str().unwrap().contains(
        "ExecStart=/opt/octomy/fleet-agent --head-less --join-file /run/octomy/fleet.json\n"
    ));
    // The join file it carries works.
    let m = Machine::new(dir.path(), "m");
    std::fs::write(m.join_file(), file["content"].as_str().unwrap()).unwrap();
    let agent = m.start(&[]);
    assert!(
        agent.wait_for("Joined", 1, WAIT),
        "log: {}",
        agent.log_text()
    );
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn operator_commands_without_a_serving_coordinator() {
    let dir = testkit::tempdir();
    let data = dir.path().join("coord");
    let cmd = || {
        let mut c = testkit::cmd("fleet-coordinator");
        c.arg("--data").arg(&data);
        c
    };
    let err = testkit::fails(cmd().arg("token"));
    assert_eq!(
        err.lines().last().unwrap(),
        "fleet-coordinator: no address to put in the join file: pass --address HOST:PORT (the coordinator is not serving from this data directory)"
    );
    let join: Value = serde_json::from_str(&testkit::ok(cmd().args([
        "token",
        "--address",
        "10.0.0.1:18426",
    ])))
    .unwrap();
    assert_eq!(join["address"], "10.0.0.1:18426");
    assert!(testkit::ok(cmd().arg("nodes")).starts_with("ID "));
}

#[test]
fn bad_join_files_each_get_one_clear_line() {
    let dir = testkit::tempdir();
    let m = Machine::new(dir.path(), "m");
    let path = m.join_file();
    let p = path.display();
    let mint = "fleet-coordinator token";
    assert_eq!(
        m.fails_with(&[]),
        format!(
            "fleet-agent: the join file {p} does not exist: pass --join-file PATH, or mint one with `{mint}`"
        )
    );
    std::fs::create_dir(&path).unwrap();
    assert_eq!(
        m.fails_with(&[]),
        format!("fleet-agent: cannot read the join file {p}: Is a directory (os error 21)")
    );
    std::fs::remove_dir(&path).unwrap();
    std::fs::write(&path, "address: nope").unwrap();
    assert_eq!(
        m.fails_with(&[]),
        format!(
            "fleet-agent: the join file {p} is not JSON (expected value at line 1 column 1): mint a new one with `{mint}`"
        )
    );
    std::fs::write(&path, r#"{"address":"127.0.0.1:1","token":"t"}"#).unwrap();
    assert_eq!(
        m.fails_with(&[]),
        format!(
            "fleet-agent: the join file {p} has no `coordinator_key` field: mint a new one with `{mint}`"
        )
    );
    let token = format!("fleet1_{}", "A".repeat(43));
    std::fs::write(
        &path,
        format!(r#"{{"address":"127.0.0.1:1","token":"{token}","coordinator_key":"rsa:abc"}}"#),
    )
    .unwrap();
    assert_eq!(
        m.fails_with(&[]),
        format!(
            "fleet-agent: the join file {p} is invalid (coordinator_key is not ed25519:<base64 of 32 bytes>): mint a new one with `{mint}`"
        )
    );
    // A token cut short on its way (one character lost) is refused before any connection: the
    // listener at the join file's address never sees one.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let key = format!("ed25519:{}", "A".repeat(43) + "=");
    std::fs::write(
        &path,
        format!(
            r#"{{"address":"{}","token":"{}","coordinator_key":"{key}"}}"#,
            listener.local_addr().unwrap(),
            &token[..token.len() - 1]
        ),
    )
    .unwrap();
    assert_eq!(
        m.fails_with(&[]),
        format!(
            "fleet-agent: the join file {p} holds a malformed token (expected fleet1_ and 43 base64url characters): it was damaged on the way; mint a new one with `{mint}`"
        )
    );
    assert_eq!(
        listener.accept().unwrap_err().kind(),
        std::io::ErrorKind::WouldBlock,
        "the agent connected with a malformed token"
    );
}

#[test]
fn bad_state_each_gets_one_clear_line_and_never_a_new_identity() {
    let dir = testkit::tempdir();
    let coord = Coordinator::start(&dir.path().join("coord"), &[]);
    let m = Machine::new(dir.path(), "m");
    std::fs::write(m.join_file(), coord.token(&[])).unwrap();
    // A state directory that cannot be written (immutable, so even root cannot).
    std::fs::create_dir_all(m.state()).unwrap();
    let _guard = Immutable::set(&m.state());
    assert_eq!(
        m.fails_with(&[]),
        format!(
            "fleet-agent: the state directory {} is not writable (Operation not permitted (os error 1)): pass --state DIR on a writable disk",
            m.state().display()
        )
    );
    drop(_guard);

    let agent = m.start(&[]);
    assert!(agent.wait_for("Joined", 1, WAIT));
    drop(agent);
    let key = m.state().join("node.key");
    let good_key = std::fs::read(&key).unwrap();
    let state = m.state().display().to_string();
    std::fs::write(
        &key,
        "-----BEGIN PRIVATE KEY-----\ngarbage\n-----END PRIVATE KEY-----\n",
    )
    .unwrap();
    let last = m.fails_with(&[]);
    assert!(
        last.starts_with(&format!(
            "fleet-agent: the node key {} is corrupt (",
            key.display()
        )) && last.ends_with(&format!(
            "): restore it, or remove {state} to join again as a new node"
        )),
        "{last}"
    );
    std::fs::remove_file(&key).unwrap();
    assert_eq!(
        m.fails_with(&[]),
        format!(
            "fleet-agent: the node key {} is corrupt (missing while {state}/membership.json exists): restore it, or remove {state} to join again as a new node",
            key.display()
        )
    );
    assert!(!key.exists(), "no new key was made");
    std::fs::write(&key, &good_key).unwrap();
    let membership = m.state().join("membership.json");
    // A pinned key that no longer reads is refused, never taken as an empty pin.
    let good: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&membership).unwrap()).unwrap();
    let mut bad_pin = good.clone();
    bad_pin["coordinator_key"] = "ed25519:AAAA".into();
    std::fs::write(&membership, bad_pin.to_string()).unwrap();
    let last = m.fails_with(&[]);
    assert!(
        last.starts_with(&format!(
            "fleet-agent: the membership record {} is corrupt (`ed25519:AAAA` is not ed25519:<base64 of 32 bytes>",
            membership.display()
        )) && last.ends_with(&format!(
            "): restore it, or remove {state} to join again as a new node"
        )),
        "{last}"
    );
    std::fs::write(&membership, "{\"node_id\": 3").unwrap();
    assert_eq!(
        m.fails_with(&[]),
        format!(
            "fleet-agent: the membership record {} is corrupt (invalid type: integer `3`, expected a string at line 1 column 13): restore it, or remove {state} to join again as a new node",
            membership.display()
        )
    );
    assert_eq!(coord.nodes().len(), 1);
}

/// `chattr +i` on a folder for the test's duration.
struct Immutable(PathBuf);

impl Immutable {
    fn set(path: &Path) -> Immutable {
        testkit::ok(std::process::Command::new("chattr").arg("+i").arg(path));
        Immutable(path.to_path_buf())
    }
}

impl Drop for Immutable {
    fn drop(&mut self) {
        let _ = std::process::Command::new("chattr")
            .arg("-i")
            .arg(&self.0)
            .status();
    }
}

#[test]
fn unreachable_coordinator_is_retried_with_growing_logged_backoff() {
    let dir = testkit::tempdir();
    let data = dir.path().join("coord");
    // A free port nobody listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let join = testkit::ok(
        testkit::cmd("fleet-coordinator")
            .arg("--data")
            .arg(&data)
            .args(["token", "--address", &format!("127.0.0.1:{port}")]),
    );
    let m = Machine::new(dir.path(), "m");
    std::fs::write(m.join_file(), join).unwrap();
    let mut agent = m.start(&["--log-format", "json"]);
    assert!(
        agent.wait_for("cannot reach the coordinator", 4, WAIT),
        "log: {}",
        agent.log_text()
    );
    assert!(
        agent.wait_exit(Duration::from_millis(10)).is_none(),
        "still retrying"
    );
    let delays: Vec<u64> = agent
        .log_text()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| v["fields"]["retry_in_ms"].as_u64())
        .collect();
    assert!(delays.len() >= 4, "{delays:?}");
    // Equal jitter: attempt n waits in [base*2^n/2, base*2^n], base 100 ms.
    for (n, d) in delays.iter().take(4).enumerate() {
        let full = 100u64 << n;
        assert!(
            (full / 2..=full).contains(d),
            "attempt {n} waited {d} ms: {delays:?}"
        );
    }
}

/// A hub on x86_64 serves machines of either architecture: the static aarch64 musl agent, run
/// under qemu-aarch64-static (user-mode emulation, so it reports the emulated machine), joins a
/// native x86_64 coordinator and reports itself as aarch64.
#[test]
fn an_arm64_agent_under_qemu_joins_an_x86_64_coordinator() {
    let binary = testkit::target_dir().join("aarch64-unknown-linux-musl/release/fleet-agent");
    assert!(
        binary.exists(),
        "{} is missing: run `cargo xtask ci`, or `cargo zigbuild --release --target aarch64-unknown-linux-musl -p fleet-agent`",
        binary.display()
    );
    let dir = testkit::tempdir();
    let coord = Coordinator::start(&dir.path().join("coord"), &[]);
    let m = Machine::new(dir.path(), "arm");
    std::fs::write(m.join_file(), coord.token(&["--name", "arm-box"])).unwrap();
    let mut qemu = std::process::Command::new("qemu-aarch64-static");
    qemu.arg(&binary).args(m.args(&[]));
    let agent = Agent::spawn(&m.log(), qemu);
    assert!(
        wait_until(WAIT, || coord
            .nodes()
            .first()
            .is_some_and(|n| n["state"] == "Joined" && n["facts"].is_object())),
        "log: {}",
        agent.log_text()
    );
    let nodes = coord.nodes();
    assert_eq!(nodes.len(), 1);
    assert_eq!(nodes[0]["name"], "arm-box");
    assert_eq!(nodes[0]["facts"]["arch"], "aarch64");
    assert!(
        nodes[0]["facts"]["accelerators"]
            .as_array()
            .unwrap()
            .is_empty()
    );
    assert!(
        wait_until(WAIT, || !m.join_file().exists()),
        "the join file is removed after joining; log: {}",
        agent.log_text()
    );
}

/// An idle node, with nothing to do but heartbeats, keeps one session for several leases: the
/// coordinator counts its heartbeats as the session's life, and the node never reconnects.
#[test]
fn an_idle_node_keeps_its_session_for_many_leases() {
    let dir = testkit::tempdir();
    let coord = Coordinator::start(&dir.path().join("coord"), &[]);
    let m = Machine::new(dir.path(), "idle");
    std::fs::write(m.join_file(), coord.token(&[])).unwrap();
    let agent = m.start(&[]);
    assert!(
        agent.wait_for("session open", 1, WAIT),
        "{}",
        agent.log_text()
    );
    // The test coordinator's lease is 2 s: three leases of nothing but heartbeats (the time
    // passing is what is tested, not a wait).
    std::thread::sleep(Duration::from_secs(6));
    assert_eq!(agent.count("session lost"), 0, "{}", agent.log_text());
    assert_eq!(agent.count("session open"), 1, "{}", agent.log_text());
    assert_eq!(coord.nodes()[0]["state"], "Joined");
}

/// AMD's and Intel's GPUs come from the kernel's own files. The trees here are stand-ins for
/// hardware the test machine does not have, laid out as a real RX 9070 XT (gfx1201), MI300X
/// (gfx942) and Arc A770 report themselves, beside a BMC display that is no accelerator. A card
/// whose report does not parse is left out with one warning, and the agent joins regardless;
/// `rocm-smi`, where present, names AMD's cards; `--where` chooses by vendor and arch.
#[test]
fn gpus_of_every_vendor_come_from_the_kernels_files() {
    use testkit::sysfs::{ARC_A770, ASPEED_BMC, Card, MI300X, RX_9070};
    let dir = testkit::tempdir();
    let coord = Coordinator::start(&dir.path().join("coord"), &[]);
    let m = Machine::new(dir.path(), "m1");
    let sys = testkit::sysfs::tree(
        &m.root.join("sys"),
        &[&ASPEED_BMC, &RX_9070, &MI300X, &ARC_A770],
    );
    let unreadable = Card {
        number: 4,
        address: "0000:0b:00.0",
        bridges: &["0000:00:05.1", "0000:0a:00.0"],
        reports: &[("mem_info_vram_total", "lots")],
        gfx_target_version: None,
        ..RX_9070
    };
    testkit::sysfs::add(&sys, &unreadable);
    std::fs::write(m.join_file(), coord.token(&["--name", "gpu-box"])).unwrap();
    let sysfs_root = sys.to_str().unwrap();
    let agent = m.start(&[
        "--sysfs-root",
        sysfs_root,
        "--rocm-tool",
        "/nonexistent/rocm-smi",
    ]);
    assert!(wait_until(WAIT, || coord
        .nodes()
        .first()
        .is_some_and(|n| n["facts"].is_object())));
    let gpus = coord.nodes()[0]["facts"]["accelerators"].clone();
    let gpus = gpus.as_array().unwrap();
    assert_eq!(gpus.len(), 3, "{gpus:#?}");
    // vendor, index, name, arch, memory in MiB, driver, id.
    let seen: Vec<String> = (gpus.iter())
        .map(|g| {
            let field = |k: &str| g[k].to_string();
            [
                "vendor",
                "index",
                "name",
                "arch",
                "memory_mib",
                "driver",
                "uuid",
            ]
            .map(field)
            .join(" ")
        })
        .collect();
    assert_eq!(
        seen,
        [
            r#""amd" 0 "AMD Radeon (gfx1201)" "gfx1201" 16368 "amdgpu" "0000:03:00.0""#,
            r#""amd" 1 "AMD Instinct MI300X OAM" "gfx942" 196592 "amdgpu" "8a0b5c3e9f4d2c71""#,
            r#""intel" 0 "Intel Arc A770" null 0 "i915" "0000:07:00.0""#,
        ]
    );
    let warning = "card4: mem_info_vram_total \"lots\" is not a number of bytes; that GPU is left out of the facts";
    assert!(agent.wait_for(warning, 1, WAIT), "{}", agent.log_text());
    assert_eq!(
        agent.count("is not a number of bytes"),
        1,
        "one warning: {}",
        agent.log_text()
    );
    let matching = |expr: &str| {
        let out = testkit::ok(coord.command().args(["nodes", "--json", "--where", expr]));
        serde_json::from_str::<Vec<Value>>(&out).unwrap().len()
    };
    assert_eq!(matching("gpu.vendor=amd,gpu.arch=gfx1201"), 1);
    assert_eq!(matching("gpu.vendor=intel,gpus>=3"), 1);
    assert_eq!(
        matching("gpu.arch=gfx950"),
        0,
        "cross-compiling for a card needs no card"
    );
    assert_eq!(matching("gpu.vendor=nvidia"), 0);

    // rocm-smi, where installed, names AMD's cards as its JSON does.
    let rocm = testkit::agent::script(
        &m.root.join("rocm-smi"),
        r#"case "$*" in "--showproductname --showuniqueid --showbus --json") printf '%s' '{"card1": {"Card Series": "AMD Radeon RX 9070 XT", "Card Model": "0x7550", "PCI Bus": "0000:03:00.0", "Unique ID": "N/A"}, "card2": {"Card series": "AMD Instinct MI300X", "PCI Bus": "0000:05:00.0", "Unique ID": "0x8a0b5c3e9f4d2c71", "GFX Version": "gfx942"}}';; *) echo "unexpected arguments: $*" >&2; exit 2;; esac"#,
    );
    let named = Machine::new(dir.path(), "m2");
    std::fs::write(named.join_file(), coord.token(&["--name", "named"])).unwrap();
    let _named = named.start(&[
        "--sysfs-root",
        sysfs_root,
        "--rocm-tool",
        rocm.to_str().unwrap(),
    ]);
    let reported =
        || (coord.nodes().into_iter()).find(|n| n["name"] == "named" && n["facts"].is_object());
    assert!(wait_until(WAIT, || reported().is_some()));
    let gpus = reported().unwrap()["facts"]["accelerators"].clone();
    assert_eq!(gpus[0]["name"], "AMD Radeon RX 9070 XT");
    assert_eq!(gpus[0]["uuid"], "0000:03:00.0", "N/A is no id");
    assert_eq!(
        (&gpus[1]["name"], &gpus[1]["uuid"]),
        (
            &Value::from("AMD Instinct MI300X"),
            &Value::from("0x8a0b5c3e9f4d2c71")
        )
    );
    assert_eq!(gpus[2]["vendor"], "intel");
}
