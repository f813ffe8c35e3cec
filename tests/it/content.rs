//! Tests: content. Programs, inputs, collected files and artifacts of any size move by digest on
//! the content path beside the session: real coordinator, agent and supervisor processes on
//! loopback (and local HTTP(S) servers for artifact URLs). Bytes on the wire are counted from the
//! coordinator's own `content sent` lines.
//!
//! Sizes: `CONTENT_TEST_MIB` (default 256) sets the large program, input and collect; the
//! issue's sizes are `CONTENT_TEST_MIB=2048` (a 2 GiB program and collect, a 1 GiB input).
use serde_json::Value;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;
use testkit::agent::{Agent, Coordinator, script, wait_until};

const WAIT: Duration = Duration::from_secs(120);

fn size() -> u64 {
    let mib: u64 = std::env::var("CONTENT_TEST_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    mib << 20
}

/// A coordinator and one joined agent, optionally reaching it through `address`.
struct Fleet {
    dir: tempfile::TempDir,
    coord: Coordinator,
    agent: Option<Agent>,
    starts: usize,
    /// Environment for the agent's process.
    agent_env: Vec<(String, String)>,
}

impl Fleet {
    fn new() -> Fleet {
        Fleet::through(|_| None, Vec::new())
    }

    /// A fleet whose join file names the address `route` gives for the coordinator's (a proxy),
    /// its agent started with `agent_env`.
    fn through(
        route: impl FnOnce(&str) -> Option<String>,
        agent_env: Vec<(String, String)>,
    ) -> Fleet {
        let dir = testkit::tempdir();
        let coord = Coordinator::start(&dir.path().join("coord"), &[]);
        let mut args = vec!["--name".to_string(), "worker".to_string()];
        if let Some(address) = route(&coord.addr) {
            args.extend(["--address".to_string(), address]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        std::fs::write(dir.path().join("fleet.json"), coord.token(&args)).unwrap();
        let mut fleet = Fleet {
            dir,
            coord,
            agent: None,
            starts: 0,
            agent_env,
        };
        fleet.start_agent();
        fleet
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn start_agent(&mut self) {
        self.starts += 1;
        let log = self.path(&format!("agent-{}.log", self.starts));
        let mut cmd = testkit::agent::machine_command(self.dir.path());
        cmd.arg("--artifact-root")
            .arg(self.path("artifacts"))
            .envs(self.agent_env.iter().cloned());
        let agent = Agent::spawn(&log, cmd);
        assert!(
            agent.wait_for("session open", 1, WAIT),
            "log: {}",
            agent.log_text()
        );
        self.agent = Some(agent);
    }

    fn kill_agent(&mut self) {
        if let Some(mut agent) = self.agent.take() {
            agent.kill();
        }
    }

    /// `coordinator run --all --program FILE EXTRA`; returns the set id.
    fn run(&self, program: &Path, extra: &[&str]) -> String {
        let out = testkit::ok(
            self.coord
                .command()
                .args(["run", "--all", "--timeout", "100s", "--program"])
                .arg(program)
                .args(extra),
        );
        out.trim().to_string()
    }

    fn row(&self, set: &str) -> Value {
        let out = testkit::ok(
            self.coord
                .command()
                .args(["status", "--set", set, "--json"]),
        );
        serde_json::from_str::<Value>(&out).unwrap()[0].clone()
    }

    /// Waits for the set's single row to be final; returns it.
    fn final_row(&self, set: &str) -> Value {
        let mut last = Value::Null;
        let ok = wait_until(WAIT, || {
            last = self.row(set);
            matches!(last["state"].as_str(), Some("finished" | "failed" | "lost"))
        });
        assert!(ok, "the row never ended: {last:#}");
        last
    }

    /// `(offset, bytes)` of each `content sent` line for `digest` in the coordinator's log.
    fn sent(&self, digest: &str) -> Vec<(u64, u64)> {
        self.moved("content sent", digest)
    }

    /// `(offset, bytes)` of each `content received` line: one per try of an upload (a cut try
    /// names no digest: it is known only once all the bytes arrived).
    fn received(&self) -> Vec<(u64, u64)> {
        self.moved("content received", "")
    }

    fn moved(&self, what: &str, digest: &str) -> Vec<(u64, u64)> {
        let field = |line: &str, name: &str| -> u64 {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(name))
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("no {name} in {line}"))
        };
        self.coord
            .log_text()
            .lines()
            .filter(|l| l.contains(what) && l.contains(digest))
            .map(|l| (field(l, "offset="), field(l, "bytes=")))
            .collect()
    }

    /// How many sessions the coordinator opened.
    /// How many sessions the node has opened, as the coordinator recorded them: each is
    /// recorded before the node hears its welcome, so no count races the log.
    fn sessions(&self) -> u64 {
        self.coord.nodes()[0]["sessions"].as_u64().unwrap()
    }

    fn collect(&self, run: &str, path: &str, out: &Path, extra: &[&str]) -> std::process::Output {
        self.coord
            .command()
            .args(["collect", "--run", run, "--path", path, "--out"])
            .arg(out)
            .args(extra)
            .output()
            .unwrap()
    }
}

/// Writes `size` incompressible bytes after `head` (a shell script that exits before them),
/// generated on the fly, one buffer at a time.
fn large_file(path: &Path, head: &str, size: u64) -> PathBuf {
    let mut file = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    file.write_all(head.as_bytes()).unwrap();
    let mut state = 0x9E37_79B9_7F4A_7C15u64 ^ size;
    let mut buf = vec![0u8; 1 << 20];
    let mut left = size - head.len() as u64;
    while left > 0 {
        for chunk in buf.chunks_mut(8) {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            chunk.copy_from_slice(&state.to_le_bytes()[..chunk.len()]);
        }
        let n = left.min(buf.len() as u64) as usize;
        file.write_all(&buf[..n]).unwrap();
        left -= n as u64;
    }
    file.flush().unwrap();
    drop(file);
    let mut perms = std::fs::metadata(path).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
    std::fs::set_permissions(path, perms).unwrap();
    path.to_path_buf()
}

fn sha256(path: &Path) -> String {
    let out = testkit::ok(std::process::Command::new("sha256sum").arg(path));
    format!("sha256:{}", out.split_whitespace().next().unwrap())
}

/// Peak memory of both sides stays under this while moving content of any size.
const FLAT_MIB: u64 = 64;

/// Nothing under `dir` (recursively) is a file.
fn no_files(dir: &Path) -> bool {
    testkit::agent::files_under(dir).is_empty()
}

#[test]
fn a_large_program_is_staged_by_digest_and_a_second_run_sends_nothing() {
    let fleet = Fleet::new();
    let size = size();
    let program = large_file(&fleet.path("big.sh"), "#!/bin/sh\necho ran\nexit 0\n", size);
    let digest = sha256(&program);
    let first = fleet.final_row(&fleet.run(&program, &[]));
    assert_eq!(first["state"], "finished", "{first:#}");
    assert_eq!(fleet.sent(&digest), [(0, size)], "sent once, whole");
    // The coordinator keeps it as a blob on disk, not in its database.
    let blob = fleet.path("coord/blobs/sha256").join(&digest[7..]);
    assert_eq!(std::fs::metadata(&blob).unwrap().len(), size);
    assert!(
        std::fs::metadata(fleet.path("coord/coordinator.redb"))
            .unwrap()
            .len()
            < size / 4
    );

    let second = fleet.final_row(&fleet.run(&program, &[]));
    assert_eq!(second["state"], "finished", "{second:#}");
    assert_eq!(
        fleet.sent(&digest),
        [(0, size)],
        "the second run sent 0 bytes"
    );
    assert_eq!(
        fleet.sessions(),
        1,
        "no run cost the node its session: {}",
        fleet.coord.log_text()
    );
    let agent = fleet.agent.as_ref().unwrap().pid();
    let (coord_mib, agent_mib) = (
        testkit::peak_rss_mib(fleet.coord.pid()),
        testkit::peak_rss_mib(agent),
    );
    eprintln!("peak RSS moving {size} bytes: coordinator {coord_mib} MiB, agent {agent_mib} MiB");
    assert!(
        coord_mib < FLAT_MIB && agent_mib < FLAT_MIB,
        "memory flat in the size: coordinator {coord_mib} MiB, agent {agent_mib} MiB"
    );
}

#[test]
fn a_large_input_reaches_the_run_checked() {
    let fleet = Fleet::new();
    let input = large_file(&fleet.path("input.bin"), "", size() / 2);
    let digest = sha256(&input);
    let program = script(&fleet.path("hash.sh"), "sha256sum data > seen.txt");
    let set = fleet.run(&program, &["--input", &format!("data={}", input.display())]);
    let row = fleet.final_row(&set);
    assert_eq!(row["state"], "finished", "{row:#}");
    assert_eq!(fleet.sent(&digest), [(0, size() / 2)]);
    let out = fleet.path("seen.txt");
    let run = row["run_id"].as_str().unwrap();
    let collected = fleet.collect(run, "seen.txt", &out, &[]);
    assert!(collected.status.success(), "{collected:?}");
    let seen = std::fs::read_to_string(&out).unwrap();
    assert_eq!(seen.split_whitespace().next().unwrap(), &digest[7..]);
}

#[test]
fn a_large_collect_streams_and_max_bytes_refuses_with_nothing_at_out() {
    let fleet = Fleet::new();
    let size = size();
    let program = script(
        &fleet.path("make.sh"),
        &format!("head -c {size} /dev/urandom > big.bin"),
    );
    let row = fleet.final_row(&fleet.run(&program, &[]));
    assert_eq!(row["state"], "finished", "{row:#}");
    let run = row["run_id"].as_str().unwrap();

    let out = fleet.path("big.out");
    let below = (size - 1).to_string();
    let refused = fleet.collect(run, "big.bin", &out, &["--max-bytes", &below]);
    assert!(!refused.status.success());
    let line = String::from_utf8_lossy(&refused.stderr);
    let line = line.lines().last().unwrap_or_default();
    assert_eq!(
        line,
        format!(
            "fleet-coordinator: run {run}: big.bin is {size} bytes, over the {below} byte limit; raise --max-bytes or collect a smaller file"
        )
    );
    assert!(!out.exists(), "nothing at --out");

    let above = (size + 1).to_string();
    let done = fleet.collect(run, "big.bin", &out, &["--max-bytes", &above]);
    assert!(done.status.success(), "{done:?}");
    let printed = String::from_utf8(done.stdout).unwrap();
    assert_eq!(printed.trim(), sha256(&out));
    assert_eq!(std::fs::metadata(&out).unwrap().len(), size);
    assert!(
        no_files(&fleet.path("coord/blobs/tmp")),
        "no temporary upload left"
    );
    let received: Vec<String> = (fleet.coord.log_text().lines())
        .filter(|l| l.contains("content received"))
        .map(str::to_string)
        .collect();
    assert_eq!(received.len(), 1, "uploaded once: {received:?}");
    let agent = fleet.agent.as_ref().unwrap().pid();
    let (coord_mib, agent_mib) = (
        testkit::peak_rss_mib(fleet.coord.pid()),
        testkit::peak_rss_mib(agent),
    );
    assert!(
        coord_mib < FLAT_MIB && agent_mib < FLAT_MIB,
        "memory flat in the size: coordinator {coord_mib} MiB, agent {agent_mib} MiB"
    );
    assert!(
        received[0].contains(&format!("digest={}", printed.trim()))
            && received[0].contains(&format!("bytes={size}")),
        "{received:?}"
    );
}

/// A TCP proxy that cuts, once, the first connection that carries more than `cut_after` bytes
/// (both ways together); every other connection it relays whole.
struct CuttingProxy {
    addr: String,
    cut: Arc<AtomicBool>,
}

impl CuttingProxy {
    fn start(target: &str, cut_after: u64) -> CuttingProxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let cut = Arc::new(AtomicBool::new(false));
        let (target, flag) = (target.to_string(), cut.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(&target) else {
                    continue;
                };
                let moved = Arc::new(AtomicU64::new(0));
                let (up_from, up_to) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                let (up_moved, up_flag) = (moved.clone(), flag.clone());
                std::thread::spawn(move || relay(up_from, up_to, up_moved, cut_after, up_flag));
                let flag = flag.clone();
                std::thread::spawn(move || relay(server, client, moved, cut_after, flag));
            }
        });
        CuttingProxy { addr, cut }
    }
}

/// Relays one direction of a connection, counting into `moved` (shared by both directions).
fn relay(
    mut from: TcpStream,
    mut to: TcpStream,
    moved: Arc<AtomicU64>,
    cut_after: u64,
    cut: Arc<AtomicBool>,
) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let total = moved.fetch_add(n as u64, Ordering::SeqCst) + n as u64;
        if total > cut_after && !cut.swap(true, Ordering::SeqCst) {
            let _ = to.shutdown(Shutdown::Both);
            let _ = from.shutdown(Shutdown::Both);
            return;
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

#[test]
fn a_transfer_cut_halfway_resumes_from_where_it_stopped() {
    let size = size();
    let mut proxy = None;
    let fleet = Fleet::through(
        |coord| {
            let started = CuttingProxy::start(coord, size / 2);
            let addr = started.addr.clone();
            proxy = Some(started);
            Some(addr)
        },
        Vec::new(),
    );
    let proxy = proxy.unwrap();
    let program = large_file(&fleet.path("big.sh"), "#!/bin/sh\nexit 0\n", size);
    let digest = sha256(&program);
    let row = fleet.final_row(&fleet.run(&program, &[]));
    assert_eq!(row["state"], "finished", "{row:#}");
    assert!(proxy.cut.load(Ordering::SeqCst), "the proxy cut a transfer");
    let sent = fleet.sent(&digest);
    assert_eq!(sent.len(), 2, "one cut fetch, one resumed: {sent:?}");
    let (resumed_at, rest) = sent[1];
    assert!(
        resumed_at >= size / 4,
        "resumed from where it stopped, not from 0: {sent:?}"
    );
    assert_eq!(resumed_at + rest, size, "{sent:?}");
    let total: u64 = sent.iter().map(|(_, b)| b).sum();
    assert!(total < size + size / 4, "not started over: {sent:?}");
    assert_eq!(fleet.sessions(), 1, "the session was not touched");
}

#[test]
fn a_collect_whose_upload_is_cut_halfway_resumes_from_where_it_stopped() {
    let size = size();
    let mut proxy = None;
    let fleet = Fleet::through(
        |coord| {
            let started = CuttingProxy::start(coord, size / 2);
            let addr = started.addr.clone();
            proxy = Some(started);
            Some(addr)
        },
        Vec::new(),
    );
    let proxy = proxy.unwrap();
    let program = script(
        &fleet.path("make.sh"),
        &format!("head -c {size} /dev/urandom > big.bin"),
    );
    let row = fleet.final_row(&fleet.run(&program, &[]));
    assert_eq!(row["state"], "finished", "{row:#}");
    assert!(
        !proxy.cut.load(Ordering::SeqCst),
        "nothing cut before the collect"
    );
    let run = row["run_id"].as_str().unwrap();
    let out = fleet.path("big.out");
    let done = fleet.collect(run, "big.bin", &out, &[]);
    assert!(done.status.success(), "{done:?}");
    assert!(proxy.cut.load(Ordering::SeqCst), "the proxy cut the upload");
    let digest = String::from_utf8(done.stdout).unwrap().trim().to_string();
    assert_eq!(digest, sha256(&out));
    assert_eq!(std::fs::metadata(&out).unwrap().len(), size);
    let received = fleet.received();
    assert_eq!(
        received.len(),
        2,
        "one cut upload, one resumed: {received:?}"
    );
    let (resumed_at, rest) = received[1];
    assert_eq!(received[0], (0, resumed_at), "resumed from what arrived");
    assert!(
        resumed_at >= size / 4,
        "resumed from where it stopped, not from 0: {received:?}"
    );
    assert_eq!(resumed_at + rest, size, "{received:?}");
    assert_eq!(fleet.sessions(), 1, "the session was not touched");
    assert!(
        no_files(&fleet.path("coord/blobs/collected")),
        "the upload moved to --out, nothing left behind"
    );
}

#[test]
fn a_collected_file_the_run_changes_between_a_cut_try_and_the_next_is_refused() {
    use std::os::unix::fs::FileExt;
    let size = size();
    let mut proxy = None;
    let fleet = Fleet::through(
        |coord| {
            let started = CuttingProxy::start(coord, size / 2);
            let addr = started.addr.clone();
            proxy = Some(started);
            Some(addr)
        },
        Vec::new(),
    );
    let proxy = proxy.unwrap();
    let program = script(
        &fleet.path("make.sh"),
        &format!("head -c {size} /dev/urandom > big.bin"),
    );
    let row = fleet.final_row(&fleet.run(&program, &[]));
    assert_eq!(row["state"], "finished", "{row:#}");
    let run = row["run_id"].as_str().unwrap();
    let file = (testkit::agent::files_under(&fleet.path("runs")).into_iter())
        .find(|p| p.ends_with("big.bin"))
        .expect("the run's big.bin");
    let out = fleet.path("big.out");
    let collect = (fleet.coord.command())
        .args(["collect", "--run", run, "--path", "big.bin", "--out"])
        .arg(&out)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The first try is cut; before the node's next one, the file's first bytes change.
    assert!(wait_until(WAIT, || proxy.cut.load(Ordering::SeqCst)));
    let changed = std::fs::OpenOptions::new().write(true).open(&file).unwrap();
    changed.write_all_at(b"changed", 0).unwrap();
    let done = collect.wait_with_output().unwrap();
    assert!(!done.status.success(), "{done:?}");
    let stderr = String::from_utf8_lossy(&done.stderr);
    let line = stderr.lines().last().unwrap_or_default();
    // The node's digest is the changed file's; what the coordinator holds began before it.
    let sent = sha256(&file);
    assert!(
        line.starts_with(&format!(
            "fleet-coordinator: content big.bin of run {run}: the coordinator refused it: content {sent}: what arrived hashes to sha256:"
        )) && line.ends_with(
                "; removed it: if the run still writes the file, collect it once it stopped"
            ),
        "{line}"
    );
    assert!(!out.exists(), "nothing at --out");
    assert!(
        no_files(&fleet.path("coord/blobs/collected")),
        "nothing kept"
    );
}

#[test]
fn content_corrupted_on_the_coordinators_disk_is_refused_and_removed_on_the_node() {
    let mut fleet = Fleet::new();
    fleet.kill_agent();
    let program = large_file(&fleet.path("prog.sh"), "#!/bin/sh\nexit 0\n", 4 << 20);
    let digest = sha256(&program);
    let set = fleet.run(&program, &[]);
    // One byte changed in the coordinator's blob, same length, before the node fetches it.
    let blob = fleet.path("coord/blobs/sha256").join(&digest[7..]);
    let mut bytes = std::fs::read(&blob).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&blob, &bytes).unwrap();
    fleet.start_agent();
    let sessions = fleet.sessions();
    let row = fleet.final_row(&set);
    assert_eq!(row["state"], "failed", "{row:#}");
    let (run, error) = (
        row["run_id"].as_str().unwrap(),
        row["error"].as_str().unwrap(),
    );
    assert!(
        error.starts_with(&format!(
            "run {run}: content {digest}: the bytes received hash to sha256:"
        )),
        "{error}"
    );
    assert!(
        error.ends_with(
            "; removed them, so the next try fetches it whole (check the sender's copy)"
        ),
        "{error}"
    );
    assert!(no_files(&fleet.path("state/content")), "nothing kept");
    // The node goes on: a good program runs in the same session.
    let good = script(&fleet.path("good.sh"), "exit 0");
    let next = fleet.final_row(&fleet.run(&good, &[]));
    assert_eq!(next["state"], "finished", "{next:#}");
    assert_eq!(fleet.sessions(), sessions, "the session stayed");
}

#[test]
fn a_disk_that_fills_mid_transfer_is_named_and_the_node_goes_on_once_space_returns() {
    let mut fleet = Fleet::new();
    fleet.kill_agent();
    let content = fleet.path("state/content");
    let disk = testkit::TinyDisk::mount(content.clone(), "16m");
    fleet.start_agent();
    let sessions = fleet.sessions();
    let program = large_file(&fleet.path("prog.sh"), "#!/bin/sh\nexit 0\n", 32 << 20);
    let digest = sha256(&program);
    let row = fleet.final_row(&fleet.run(&program, &[]));
    assert_eq!(row["state"], "failed", "{row:#}");
    let (run, error) = (
        row["run_id"].as_str().unwrap(),
        row["error"].as_str().unwrap(),
    );
    assert!(
        error.starts_with(&format!(
            "run {run}: content {digest}: the disk holding {} is full (",
            content.display()
        )) && error.ends_with("); removed the partial content, free space there and run it again"),
        "{error}"
    );
    assert!(no_files(&content), "the partial content is removed");
    assert_eq!(fleet.sessions(), sessions, "the session stayed");
    disk.resize("64m");
    let again = fleet.final_row(&fleet.run(&program, &[]));
    assert_eq!(again["state"], "finished", "{again:#}");
    assert_eq!(fleet.sessions(), sessions);
    fleet.kill_agent();
}

/// `replicate ARGS` through the serving coordinator: its JSON on success, else its last line.
fn replicate(fleet: &Fleet, args: &[&str]) -> Result<Value, String> {
    let out = fleet
        .coord
        .command()
        .args(["replicate", "--node", "worker"])
        .args(args)
        .output()
        .unwrap();
    match out.status.success() {
        true => Ok(serde_json::from_slice(&out.stdout).unwrap()),
        false => Err(String::from_utf8_lossy(&out.stderr)
            .lines()
            .last()
            .unwrap_or_default()
            .to_string()),
    }
}

#[test]
fn an_artifact_is_replicated_with_a_one_time_ticket_timed_and_published_as_the_link() {
    let fleet = Fleet::new();
    let size = size() / 4;
    let artifact = large_file(&fleet.path("model.bin"), "", size);
    let digest = sha256(&artifact);
    let copy = replicate(&fleet, &["--file", artifact.to_str().unwrap()]).unwrap();
    assert_eq!(copy["digest"], digest.as_str());
    assert_eq!(copy["size"], size);
    let rate = copy["bytes_per_s"].as_u64().unwrap();
    assert!(rate > 0, "{copy}");
    let landed = fleet.path("artifacts/sha256").join(&digest[7..]);
    assert_eq!(sha256(&landed), digest, "checked and in the artifact root");
    assert_eq!(fleet.sent(&digest), [(0, size)]);
    // The node publishes the slowest whole copy as its measured link.
    let nodes = fleet.coord.nodes();
    let link = &nodes[0]["facts"]["measured_link"];
    assert_eq!(link["bytes_per_s"], rate, "{link}");
    assert_eq!(link["confidence"], 0.9);
    assert_eq!(link["basis"], "whole_copy");
    assert!(link["valid_for_ms"].as_u64().unwrap() > 3_500_000, "{link}");
    // Again: the node holds it, nothing moves.
    let again = replicate(&fleet, &["--file", artifact.to_str().unwrap()]).unwrap();
    assert_eq!(again["copy_ms"], 0);
    assert_eq!(fleet.sent(&digest), [(0, size)]);
}

/// A small HTTP(S) server for one file, as an object store serves a presigned URL: `GET /art`
/// (honouring `Range: bytes=N-`), 403 for any other path; counts the requests it answered.
struct FileServer {
    addr: String,
    requests: Arc<std::sync::atomic::AtomicUsize>,
}

impl FileServer {
    fn start(file: PathBuf, tls: Option<Arc<rustls::ServerConfig>>) -> FileServer {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let requests = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = requests.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                match &tls {
                    None => answer(stream, &file, &counted),
                    Some(config) => {
                        let server = rustls::ServerConnection::new(config.clone()).unwrap();
                        answer(rustls::StreamOwned::new(server, stream), &file, &counted);
                    }
                }
            }
        });
        FileServer { addr, requests }
    }
}

fn answer(mut stream: impl Read + Write, file: &Path, counted: &std::sync::atomic::AtomicUsize) {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") && stream.read(&mut byte).unwrap_or(0) == 1 {
        head.push(byte[0]);
    }
    if head.is_empty() {
        return;
    }
    counted.fetch_add(1, Ordering::SeqCst);
    let head = String::from_utf8_lossy(&head).to_string();
    if !head.starts_with("GET /art ") {
        let _ = stream.write_all(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n");
        let _ = stream.flush();
        return;
    }
    let size = std::fs::metadata(file).unwrap().len();
    let from: u64 = head
        .lines()
        .find_map(|l| l.strip_prefix("Range: bytes="))
        .and_then(|r| r.trim_end_matches('-').parse().ok())
        .unwrap_or(0);
    let status = match from {
        0 => format!("HTTP/1.1 200 OK\r\nContent-Length: {size}\r\n\r\n"),
        _ => format!(
            "HTTP/1.1 206 Partial Content\r\nContent-Length: {}\r\nContent-Range: bytes {from}-{}/{size}\r\n\r\n",
            size - from,
            size - 1
        ),
    };
    let mut body = std::fs::File::open(file).unwrap();
    std::io::Seek::seek(&mut body, std::io::SeekFrom::Start(from)).unwrap();
    let _ = stream.write_all(status.as_bytes());
    let _ = std::io::copy(&mut body, &mut stream);
    let _ = stream.flush();
}

/// A TLS server configuration from the test PKI's loopback certificate.
fn tls_server(pki: &testkit::pki::Pki) -> Arc<rustls::ServerConfig> {
    let pem = |p: &Path| std::fs::read(p).unwrap();
    let certs = rustls_pemfile::certs(&mut pem(&pki.server_cert).as_slice())
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let key = rustls_pemfile::private_key(&mut pem(&pki.server_key).as_slice())
        .unwrap()
        .unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .unwrap();
    Arc::new(config)
}

#[test]
fn an_artifact_from_an_expiring_url_is_fetched_checked_and_timed_and_refused_once_expired() {
    let fleet = Fleet::new();
    let size = size() / 4;
    let artifact = large_file(&fleet.path("data.bin"), "", size);
    let digest = sha256(&artifact);
    let server = FileServer::start(artifact.clone(), None);
    let url = format!("http://{}/art", server.addr);
    // Expired before the node takes it up: refused by the node, the URL never asked.
    let expired = replicate(
        &fleet,
        &["--digest", &digest, "--url", &url, "--expires-in", "0s"],
    );
    assert_eq!(
        expired.unwrap_err(),
        format!(
            "fleet-coordinator: content {digest}: its URL read expired before the copy began; mint a new one"
        )
    );
    assert_eq!(server.requests.load(Ordering::SeqCst), 0);
    // A URL the store no longer honours (its own expiry): its status, in the node's words.
    let stale = format!("http://{}/expired", server.addr);
    let refused = replicate(
        &fleet,
        &["--digest", &digest, "--url", &stale, "--expires-in", "1m"],
    );
    assert_eq!(
        refused.unwrap_err(),
        format!(
            "fleet-coordinator: content {digest}: the URL answered HTTP 403; the read may be expired or wrong, mint a new one"
        )
    );
    let copy = replicate(
        &fleet,
        &["--digest", &digest, "--url", &url, "--expires-in", "1m"],
    )
    .unwrap();
    assert_eq!(copy["size"], size);
    assert!(copy["bytes_per_s"].as_u64().unwrap() > 0, "{copy}");
    let landed = fleet.path("artifacts/sha256").join(&digest[7..]);
    assert_eq!(sha256(&landed), digest);
    assert_eq!(server.requests.load(Ordering::SeqCst), 2);
    assert!(
        !fleet.coord.log_text().contains(&url),
        "the URL (a credential) is never logged"
    );
}

#[test]
fn a_command_with_no_minted_read_is_refused_in_the_nodes_words() {
    let fleet = Fleet::new();
    let digest = format!("sha256:{}", "ab".repeat(32));
    assert_eq!(
        replicate(&fleet, &["--digest", &digest]).unwrap_err(),
        format!(
            "fleet-coordinator: artifact {digest}: the command carries no minted read (a coordinator ticket or an expiring URL), and this node holds no standing credential to any store; mint a read for this one fetch"
        )
    );
    assert!(no_files(&fleet.path("artifacts")));
}

#[test]
fn the_blob_sweep_removes_only_content_no_run_refers_to_after_its_grace() {
    use fleet_coordinator::store::conformance;
    use fleet_coordinator::{Coordinator, StoreLocation};
    let dir = testkit::tempdir();
    let coordinator =
        Coordinator::open(&dir.path().join("coord"), &StoreLocation::Embedded).unwrap();
    let import = |name: &str| {
        let file = dir.path().join(name);
        std::fs::write(&file, name).unwrap();
        coordinator.blobs().import(&file).unwrap().0
    };
    let (program, input, loose) = (import("program"), import("input"), import("loose"));
    let mut run = conformance::run("r1", "s1", "n-1", b"", 1);
    run.workload = fleet_proto::run::Workload::Program(program);
    run.options.inputs = vec![("data".into(), input)];
    coordinator
        .store()
        .create_set(&"s1".into(), &[run])
        .unwrap();
    let cut_upload = coordinator.blobs().collected_partial(&"u1".into());
    std::fs::create_dir_all(cut_upload.parent().unwrap()).unwrap();
    std::fs::write(&cut_upload, "half").unwrap();
    coordinator.sweep_blobs(Duration::from_secs(3600)).unwrap();
    assert!(
        coordinator.blobs().has(&loose),
        "within its grace a blob stays"
    );
    assert!(cut_upload.exists(), "within its grace a cut upload stays");
    coordinator.sweep_blobs(Duration::ZERO).unwrap();
    assert!(
        !coordinator.blobs().has(&loose),
        "no run refers to it: removed"
    );
    assert!(!cut_upload.exists(), "an upload nobody finished: removed");
    assert!(
        coordinator.blobs().has(&program),
        "a stored run's program stays"
    );
    assert!(
        coordinator.blobs().has(&input),
        "a stored run's input stays"
    );
}

#[test]
fn an_artifact_from_an_https_url_is_checked_against_the_machines_roots() {
    let pki = testkit::pki::Pki::new();
    let env = vec![(
        "SSL_CERT_FILE".to_string(),
        pki.ca_cert.display().to_string(),
    )];
    let fleet = Fleet::through(|_| None, env);
    let artifact = large_file(&fleet.path("data.bin"), "", 8 << 20);
    let digest = sha256(&artifact);
    let server = FileServer::start(artifact.clone(), Some(tls_server(&pki)));
    let url = format!("https://{}/art", server.addr);
    let copy = replicate(
        &fleet,
        &["--digest", &digest, "--url", &url, "--expires-in", "1m"],
    );
    let copy = copy.unwrap();
    assert_eq!(copy["size"], 8 << 20);
    let landed = fleet.path("artifacts/sha256").join(&digest[7..]);
    assert_eq!(sha256(&landed), digest);

    // A node whose roots do not include the server's CA refuses it, naming the handshake.
    let other = Fleet::new();
    let refused = replicate(
        &other,
        &["--digest", &digest, "--url", &url, "--expires-in", "1m"],
    );
    let line = refused.unwrap_err();
    assert!(
        line.starts_with(&format!(
            "fleet-coordinator: content {digest}: the TLS handshake with {} failed (",
            server.addr
        )) && line.ends_with("); is its certificate signed by a root this machine trusts?"),
        "{line}"
    );
}

#[test]
fn a_transfer_cut_by_a_coordinator_restart_resumes_from_where_it_stopped() {
    let mut fleet = Fleet::new();
    let size = size();
    let program = large_file(&fleet.path("big.sh"), "#!/bin/sh\nexit 0\n", size);
    let digest = sha256(&program);
    let set = fleet.run(&program, &[]);
    // SIGKILL the coordinator once the node holds half of the program, then serve again.
    let partial = fleet.path("state/content/partial").join(&digest[7..]);
    let half = wait_until(WAIT, || {
        std::fs::metadata(&partial).is_ok_and(|m| m.len() >= size / 2)
    });
    assert!(half, "the fetch never got halfway");
    fleet.coord.restart();
    let row = fleet.final_row(&set);
    assert_eq!(row["state"], "finished", "{row:#}");
    // Only the restarted coordinator could log its sending: it resumed, it did not start over.
    let sent = fleet.sent(&digest);
    let (resumed_at, rest) = *sent.last().unwrap();
    assert!(resumed_at >= size / 2, "{sent:?}");
    assert_eq!(resumed_at + rest, size, "{sent:?}");
}
