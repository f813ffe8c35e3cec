//! Helpers for the agent tests: a coordinator and agents as real processes, stand-in
//! `nvidia-smi` scripts, and a TCP proxy that loses the coordinator's answers.
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Polls `check` every 20 ms until it holds or `timeout` passes; returns whether it held.
pub fn wait_until(timeout: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if check() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits up to `timeout` for `child` to exit on its own.
fn wait_exit(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

/// A `fleet-agent coordinator serve` process on loopback, killed when dropped.
pub struct Coordinator {
    pub data: PathBuf,
    pub addr: String,
    pub log: PathBuf,
    extra: Vec<String>,
    child: Option<Child>,
}

impl Coordinator {
    /// Starts on a free port with a fast heartbeat (200 ms) and a short lease (2 s), unless
    /// `extra` sets them, plus `extra` flags.
    pub fn start(data: &Path, extra: &[&str]) -> Coordinator {
        Coordinator::start_on(data, "127.0.0.1:0", extra)
    }

    /// Like [`start`](Self::start), listening on `listen` (an address of the test's own, such as
    /// its side of a veth pair, with port 0 for a free one).
    pub fn start_on(data: &Path, listen: &str, extra: &[&str]) -> Coordinator {
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        let mut c = Coordinator {
            data: data.to_path_buf(),
            addr: listen.into(),
            log: data.with_extension("serve.log"),
            extra,
            child: None,
        };
        c.spawn();
        c
    }

    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("can open the coordinator log");
        // The fast defaults, unless the test sets its own.
        let mut defaults = Vec::new();
        // Metrics on a free port: many coordinators of many tests share this machine.
        let defaults_of_tests = [
            ("--heartbeat", "200ms"),
            ("--lease", "2s"),
            ("--metrics-listen", "127.0.0.1:0"),
        ];
        for (flag, value) in defaults_of_tests {
            if !self.extra.iter().any(|e| e == flag) {
                defaults.extend([flag, value]);
            }
        }
        let mut child = crate::cmd("fleet-coordinator")
            .arg("--data")
            .arg(&self.data)
            .args(["serve", "--listen", &self.addr])
            .args(defaults)
            .args(&self.extra)
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .expect("can start the coordinator");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("piped stdout"))
            .read_line(&mut line)
            .expect("the coordinator prints its address");
        self.addr = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("unexpected first line from serve: {line:?}"))
            .to_string();
        self.child = Some(child);
    }

    /// The `host:port` the serving process answers /metrics, /healthz and /readyz on, from the
    /// newest line of its log that says so.
    pub fn metrics_addr(&self) -> String {
        let mut found = None;
        let said = wait_until(Duration::from_secs(10), || {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            found = (log.lines().rev())
                .find_map(|l| l.split("serving metrics on http://").nth(1))
                .and_then(|rest| rest.split("/metrics").next())
                .map(str::to_string);
            found.is_some()
        });
        assert!(said, "the coordinator never logged its metrics address");
        found.unwrap_or_default()
    }

    /// The serving process's id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("serving").id()
    }

    /// Kills the coordinator (SIGKILL: no goodbye to anyone).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Waits up to `timeout` for the serving process to exit by itself (after a signal).
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let status = wait_exit(self.child.as_mut().expect("serving"), timeout);
        if status.is_some() {
            self.child = None;
        }
        status
    }

    /// Starts it again on the same port and data.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// Stops it as an operator does (SIGTERM: its sessions are told to go, and it drains), waits
    /// for it to exit, and starts it again on the same port and data; returns how it exited.
    pub fn restart_gracefully(&mut self) -> Option<ExitStatus> {
        let exited = self.stop_gracefully();
        self.kill();
        self.spawn();
        exited
    }

    /// Stops it as an operator does (SIGTERM) and waits for it to exit; returns how it exited.
    pub fn stop_gracefully(&mut self) -> Option<ExitStatus> {
        let term = crate::output(
            Command::new("kill")
                .args(["-TERM", &self.pid().to_string()])
                .stdin(Stdio::null()),
        );
        assert!(term.status.success(), "kill -TERM failed");
        self.wait_exit(Duration::from_secs(60))
    }

    /// `fleet-coordinator token` with extra flags; returns the join file's JSON text.
    pub fn token(&self, args: &[&str]) -> String {
        crate::ok(self.command().arg("token").args(args))
    }

    /// `fleet-coordinator nodes --json`.
    pub fn nodes(&self) -> Vec<serde_json::Value> {
        let out = crate::ok(self.command().args(["nodes", "--json"]));
        serde_json::from_str::<serde_json::Value>(&out)
            .expect("nodes --json prints JSON")
            .as_array()
            .expect("nodes --json prints an array")
            .clone()
    }

    /// `status --set SET --json`: the set's rows.
    pub fn rows(&self, set: &str) -> Vec<serde_json::Value> {
        let out = crate::ok(self.command().args(["status", "--set", set, "--json"]));
        serde_json::from_str::<serde_json::Value>(&out)
            .expect("status --json prints JSON")
            .as_array()
            .expect("status --json prints an array")
            .clone()
    }

    /// `rollout status --watch`, stopped by `timeout` after `seconds` (exit 124) should it hang.
    pub fn watch_rollout(&self, seconds: u64) -> std::process::Output {
        let mut watch = Command::new("timeout");
        watch
            .arg(seconds.to_string())
            .arg(crate::bin("fleet-coordinator"));
        watch.arg("--data").arg(&self.data);
        watch.args(["rollout", "status", "--watch"]);
        watch.output().expect("timeout runs")
    }

    /// A `fleet-coordinator --data DATA` command.
    pub fn command(&self) -> Command {
        let mut cmd = crate::cmd("fleet-coordinator");
        cmd.arg("--data").arg(&self.data);
        cmd
    }

    /// Runs `fleet-coordinator ARGS`, which must fail; returns the error, its last line on stderr.
    pub fn refusal(&self, args: &[&str]) -> String {
        let err = crate::fails(self.command().args(args));
        err.lines().last().unwrap_or_default().to_string()
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Coordinator {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A `fleet-agent` process whose stderr goes to a file, killed when dropped.
/// `fleet-agent` for a machine whose files all live in `dir`: the join file `dir/fleet.json`, its
/// state, run store and cloud-init folder beside it, no accelerator tool, a fast first retry.
pub fn machine_command(dir: &Path) -> Command {
    let mut cmd = crate::cmd("fleet-agent");
    cmd.arg("--join-file")
        .arg(dir.join("fleet.json"))
        .arg("--state")
        .arg(dir.join("state"))
        .arg("--run-store")
        .arg(dir.join("runs"))
        .arg("--cloud-root")
        .arg(dir.join("cloud"))
        .args(["--accelerator-tool", "/nonexistent/nvidia-smi"])
        .args(["--retry-base", "50ms"]);
    cmd
}

pub struct Agent {
    pub log: PathBuf,
    child: Child,
}

impl Agent {
    /// Starts `fleet-agent ARGS`, logging to `log`.
    pub fn start<I, S>(log: &Path, args: I) -> Agent
    where
        I: IntoIterator<Item = S>,
        S: AsRef<std::ffi::OsStr>,
    {
        let mut cmd = crate::cmd("fleet-agent");
        cmd.args(args);
        Agent::spawn(log, cmd)
    }

    /// Starts `cmd` as the agent (another build, or one run under an emulator), logging to `log`.
    pub fn spawn(log: &Path, mut cmd: Command) -> Agent {
        let file = std::fs::File::create(log).expect("can create the agent log");
        let child = cmd
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start the agent {:?}: {e}", cmd.get_program()));
        Agent {
            log: log.to_path_buf(),
            child,
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// How many times `needle` occurs in the log.
    pub fn count(&self, needle: &str) -> usize {
        self.log_text().matches(needle).count()
    }

    /// Waits until the log holds `needle` at least `times` times.
    pub fn wait_for(&self, needle: &str, times: usize, timeout: Duration) -> bool {
        wait_until(timeout, || self.count(needle) >= times)
    }

    /// Waits for the process to exit on its own.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        wait_exit(&mut self.child, timeout)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Writes an executable shell script.
pub fn script(path: &Path, body: &str) -> PathBuf {
    std::fs::write(path, format!("#!/bin/sh\n{body}\n")).expect("can write a script");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).expect("can chmod");
    path.to_path_buf()
}

/// A stand-in for `nvidia-smi` (no GPU exists on the test machine) answering the agent's query
/// with four GPUs, in the real tool's `--format=csv,noheader,nounits` shape.
pub fn stand_in_four_gpus(dir: &Path) -> PathBuf {
    let lines: String = (0..4)
        .map(|i| format!("{i}, NVIDIA H100 80GB HBM3, GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd, 81559, 550.54.15\\n"))
        .collect();
    script(
        &dir.join("nvidia-smi"),
        &format!(
            "case \"$*\" in *--query-gpu=index,name,uuid,memory.total,driver_version*--format=csv,noheader,nounits*) printf '{lines}';; *) echo unexpected arguments >&2; exit 2;; esac"
        ),
    )
}

/// A TCP proxy in front of the coordinator that, for the first `drops` connections, forwards the
/// TLS handshake and the agent's request but throws the coordinator's answer away and cuts both
/// sides: the answer was lost after the coordinator acted on the request.
pub struct DroppingProxy {
    pub addr: String,
    pub dropped: Arc<AtomicUsize>,
}

impl DroppingProxy {
    pub fn start(target: &str, drops: usize) -> DroppingProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("can bind the proxy");
        let addr = listener.local_addr().expect("bound").to_string();
        let dropped = Arc::new(AtomicUsize::new(0));
        let (target, counter) = (target.to_string(), dropped.clone());
        std::thread::spawn(move || {
            for (index, client) in listener.incoming().enumerate() {
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(&target) else {
                    continue;
                };
                let lose_answer = index < drops;
                let counter = counter.clone();
                std::thread::spawn(move || relay(client, server, lose_answer, counter));
            }
        });
        DroppingProxy { addr, dropped }
    }
}

const QUIET: u8 = 0;
const SERVER_SPOKE: u8 = 1;
const CLIENT_ANSWERED_HANDSHAKE: u8 = 2;

fn relay(client: TcpStream, server: TcpStream, lose_answer: bool, dropped: Arc<AtomicUsize>) {
    // The server speaks once (its handshake flight), the client then sends its own flight and
    // the request; whatever the server sends after that is the answer.
    let phase = Arc::new(AtomicU8::new(QUIET));
    let (mut c_read, mut s_write) = (
        client.try_clone().expect("clone"),
        server.try_clone().expect("clone"),
    );
    let up_phase = phase.clone();
    let up = std::thread::spawn(move || {
        let mut buf = [0u8; 16 << 10];
        while let Ok(n) = c_read.read(&mut buf) {
            if n == 0 {
                break;
            }
            // Marked before forwarding, so the server cannot answer before we know it is an answer.
            let _ = up_phase.compare_exchange(
                SERVER_SPOKE,
                CLIENT_ANSWERED_HANDSHAKE,
                Ordering::SeqCst,
                Ordering::SeqCst,
            );
            if s_write.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        let _ = s_write.shutdown(Shutdown::Write);
    });
    let (mut s_read, mut c_write) = (server, client);
    let mut buf = [0u8; 16 << 10];
    while let Ok(n) = s_read.read(&mut buf) {
        if n == 0 {
            break;
        }
        if lose_answer && phase.load(Ordering::SeqCst) == CLIENT_ANSWERED_HANDSHAKE {
            dropped.fetch_add(1, Ordering::SeqCst);
            let _ = c_write.shutdown(Shutdown::Both);
            let _ = s_read.shutdown(Shutdown::Both);
            break;
        }
        let _ = phase.compare_exchange(QUIET, SERVER_SPOKE, Ordering::SeqCst, Ordering::SeqCst);
        if c_write.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = c_write.shutdown(Shutdown::Both);
    let _ = up.join();
}

/// Every file under `dir`, recursively.
pub fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else {
                out.push(path);
            }
        }
    }
    out
}

/// Whether any file under `dir` contains `needle`'s bytes.
pub fn any_file_contains(dir: &Path, needle: &str) -> Option<PathBuf> {
    files_under(dir).into_iter().find(|p| {
        std::fs::read(p)
            .map(|bytes| bytes.windows(needle.len()).any(|w| w == needle.as_bytes()))
            .unwrap_or(false)
    })
}

/// A node driven by hand in a test: a join file minted by `coord` for `name`, the node key in
/// `dir/name`, and a runtime to drive the protocol on.
pub struct HandNode {
    pub join: fleet_proto::joinfile::JoinFile,
    pub identity: fleet_agent::identity::Identity,
    pub runtime: tokio::runtime::Runtime,
}

impl HandNode {
    pub fn new(dir: &Path, coord: &Coordinator, name: &str) -> HandNode {
        let join = serde_json::from_str(&coord.token(&["--name", name])).expect("a join file");
        let state = dir.join(name);
        fleet_agent::identity::prepare_state_dir(&state).expect("a state folder");
        let identity = fleet_agent::identity::load_or_create(&state).expect("a node key");
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        HandNode {
            join,
            identity,
            runtime,
        }
    }
}
