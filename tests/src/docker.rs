//! The real Docker engine in tests: a static busybox image made with this project's own
//! `oci build`, pushed with `oci push` to a loopback registry the engine pulls from, and the
//! removal of every container a test made (by its agent label), even when the test fails.
use crate::registry::Registry;
use fleet_agent::runtime::DockerRuntime;
use fleet_agent::runtime::docker::{EngineAddress, LABEL_AGENT};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The busybox applets the tests' scripts use, as links in the image's `/bin`.
const APPLETS: &[&str] = &[
    "sh", "sleep", "printf", "echo", "cat", "ln", "kill", "dd", "head", "true", "false", "env",
    "ls", "tail", "id",
];

/// A folder holding `/bin/busybox` (Debian's static build) and its applets as links.
pub fn busybox_root(dir: &Path) -> PathBuf {
    let root = dir.join("busybox-root");
    let bin = root.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::create_dir_all(root.join("tmp")).unwrap();
    std::fs::copy("/bin/busybox", bin.join("busybox"))
        .expect("busybox-static is installed (cargo xtask ci installs it)");
    for applet in APPLETS {
        std::os::unix::fs::symlink("busybox", bin.join(applet)).unwrap();
    }
    root
}

/// Builds the busybox image (entrypoint `/bin/sh`), pushes it to `registry` as `REPO:v1`
/// (with `creds` when the registry needs them) and returns `HOST/REPO@sha256:HEX`. The image
/// holds `/id` with `id`, so tests that must see a first pull use an id of their own.
pub fn busybox_image(registry: &Registry, repo: &str, creds: Option<&str>, id: &str) -> String {
    let dir = crate::tempdir();
    let layout = dir.path().join("layout");
    let root = busybox_root(dir.path());
    std::fs::write(root.join("id"), id).unwrap();
    crate::ok(
        crate::cmd("oci")
            .args(["build", "--layout"])
            .arg(&layout)
            .args(["--ref", "v1", "--root"])
            .arg(&root)
            .args(["--entrypoint", "/bin/sh", "--compression", "gzip"]),
    );
    let mut push = crate::cmd("oci");
    push.args(["push", "--plain-http", "--quiet"])
        .arg(format!("oci:{}:v1", layout.display()))
        .arg(registry.image(&format!("{repo}:v1")));
    if let Some(creds) = creds {
        push.args(["--creds", creds]);
    }
    let digest = crate::ok(&mut push).trim().to_string();
    format!("{}/{repo}@{digest}", registry.host())
}

/// The engine's version, as the runtime negotiated it; every test prints it.
pub fn engine_version(rt: &DockerRuntime) -> String {
    let version = rt.engine_version().to_string();
    eprintln!("Docker engine {version}");
    version
}

/// The containers of one test's agent label: removed when made (leftovers of an earlier,
/// killed run) and when dropped, whether the test passed or not.
pub struct Containers {
    pub agent: String,
    marks: tempfile::TempDir,
    images: std::cell::RefCell<Vec<String>>,
}

impl Containers {
    /// A label unique to this test process and `name`.
    pub fn new(name: &str) -> Containers {
        let containers = Containers {
            agent: format!("test-{name}-{}", std::process::id()),
            marks: crate::tempdir(),
            images: Default::default(),
        };
        containers.remove_all();
        containers
    }

    /// The containers of an agent that labels them `agent` (a real agent uses its node id).
    pub fn of_agent(agent: &str) -> Containers {
        let containers = Containers {
            agent: agent.to_string(),
            marks: crate::tempdir(),
            images: Default::default(),
        };
        containers.remove_all();
        containers
    }

    /// A busybox image of this test's own (a digest no other test has), removed from the
    /// engine when dropped.
    pub fn image(&self, registry: &Registry, repo: &str, creds: Option<&str>) -> String {
        let id = format!("{} {:?}", self.agent, std::time::SystemTime::now());
        let image = busybox_image(registry, repo, creds, &id);
        self.images.borrow_mut().push(image.clone());
        image
    }

    /// A runtime on the local engine whose containers carry this label.
    pub fn runtime(&self) -> DockerRuntime {
        self.runtime_at(&EngineAddress::default())
    }

    pub fn runtime_at(&self, address: &EngineAddress) -> DockerRuntime {
        DockerRuntime::connect(address, self.marks.path(), &self.agent, Default::default())
            .expect("the local Docker engine answers")
    }

    /// Where the runtime records why a run ended (`RUN.timed-out`, `RUN.stopped`).
    pub fn marks(&self) -> &Path {
        self.marks.path()
    }

    /// Names of this label's containers, as the engine lists them.
    pub fn names(&self) -> Vec<String> {
        let out = crate::ok(Command::new("docker").args([
            "ps",
            "-a",
            "--filter",
            &format!("label={LABEL_AGENT}={}", self.agent),
            "--format",
            "{{.Names}}",
        ]));
        out.lines().map(str::to_string).collect()
    }

    fn remove_all(&self) {
        let names = self.names();
        if !names.is_empty() {
            let _ = Command::new("docker")
                .args(["rm", "-f"])
                .args(&names)
                .output();
        }
    }
}

impl Drop for Containers {
    fn drop(&mut self) {
        self.remove_all();
        let images = self.images.borrow();
        if !images.is_empty() {
            let _ = Command::new("docker")
                .args(["rmi", "-f"])
                .args(images.iter())
                .output();
        }
    }
}

/// Removes containers named `octomy-run-PREFIX*` whatever their label (a killed earlier run
/// of the same test), so a fixed run id starts clean.
pub fn remove_named(prefix: &str) {
    let out = crate::ok(Command::new("docker").args([
        "ps",
        "-a",
        "--filter",
        &format!("name=octomy-run-{prefix}"),
        "--format",
        "{{.Names}}",
    ]));
    let names: Vec<&str> = out.lines().collect();
    if !names.is_empty() {
        let _ = Command::new("docker")
            .args(["rm", "-f"])
            .args(&names)
            .output();
    }
}

/// The local engine behind a TLS terminator that requires a client certificate signed by the
/// PKI's CA (Debian's `stunnel4` in front of the engine's socket, on a loopback port), as a
/// remote engine on port 2376 would be. Stopped when dropped.
pub struct TlsEngine {
    child: std::process::Child,
    _dir: tempfile::TempDir,
    pub host: String,
}

impl TlsEngine {
    pub fn start(pki: &crate::pki::Pki) -> TlsEngine {
        let dir = crate::tempdir();
        let port = crate::registry::free_port();
        let config = dir.path().join("stunnel.conf");
        std::fs::write(
            &config,
            format!(
                "foreground = yes\npid =\noutput = {log}\n[engine]\naccept = 127.0.0.1:{port}\nconnect = /var/run/docker.sock\ncert = {cert}\nkey = {key}\nCAfile = {ca}\nrequireCert = yes\nverifyChain = yes\n",
                log = dir.path().join("stunnel.log").display(),
                cert = pki.server_cert.display(),
                key = pki.server_key.display(),
                ca = pki.ca_cert.display(),
            ),
        )
        .unwrap();
        let child = Command::new("stunnel4")
            .arg(&config)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("stunnel4 is installed (cargo xtask ci installs it)");
        let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let listening = crate::agent::wait_until(std::time::Duration::from_secs(60), || {
            std::net::TcpStream::connect(addr).is_ok()
        });
        assert!(listening, "stunnel4 did not listen on {addr}");
        TlsEngine {
            child,
            _dir: dir,
            host: format!("https://{addr}"),
        }
    }
}

impl Drop for TlsEngine {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A stand-in for a Docker 29 engine, whose oldest API is 1.44, because none can run here (this
/// machine's engine is 20.10, API 1.41): a loopback HTTP proxy in front of the local engine's
/// socket that answers `/version` as 29.0.0 with API 1.44 as both its newest and its oldest
/// version, refuses a request whose path names any other version, as a real engine refuses one
/// below its minimum or above its maximum (with the engine's own wording), and forwards the rest
/// with the version taken off the path, so the real engine answers at its own. One request per
/// connection (`Connection: close`). Every request line is kept.
pub struct Docker29StandIn {
    pub host: String,
    seen: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

/// What the stand-in says it supports, newest and oldest alike.
pub const STAND_IN_API: &str = "1.44";

impl Docker29StandIn {
    pub fn start() -> Docker29StandIn {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let host = format!("tcp://{}", listener.local_addr().unwrap());
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let log = seen.clone();
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let log = log.clone();
                std::thread::spawn(move || {
                    let _ = stand_in_serve(client, &log);
                });
            }
        });
        Docker29StandIn { host, seen }
    }

    /// `METHOD TARGET` of every request so far.
    pub fn requests(&self) -> Vec<String> {
        self.seen.lock().unwrap().clone()
    }
}

fn stand_in_serve(
    client: std::net::TcpStream,
    seen: &std::sync::Mutex<Vec<String>>,
) -> std::io::Result<()> {
    use std::io::{BufRead, Write};
    let mut reader = std::io::BufReader::new(client.try_clone()?);
    let mut request = String::new();
    reader.read_line(&mut request)?;
    let mut headers = String::new();
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 || line == "\r\n" {
            break;
        }
        if !line.to_ascii_lowercase().starts_with("connection:") {
            headers.push_str(&line);
        }
    }
    let mut parts = request.split_whitespace();
    let (method, target, proto) = (
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or("HTTP/1.1"),
    );
    seen.lock().unwrap().push(format!("{method} {target}"));
    let (version, path) = match target.strip_prefix("/v").and_then(|t| t.split_once('/')) {
        Some((v, rest)) if v.contains('.') => (Some(v), format!("/{rest}")),
        _ => (None, target.to_string()),
    };
    let mut out = client.try_clone()?;
    let answer = |out: &mut std::net::TcpStream, status: &str, body: serde_json::Value| {
        let body = body.to_string();
        write!(
            out,
            "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
    };
    if path == "/version" || path.starts_with("/version?") {
        return answer(
            &mut out,
            "200 OK",
            serde_json::json!({
                "Version": "29.0.0",
                "ApiVersion": STAND_IN_API,
                "MinAPIVersion": STAND_IN_API,
                "Os": "linux",
                "Arch": "amd64",
            }),
        );
    }
    if let Some(v) = version.filter(|v| *v != STAND_IN_API) {
        let older = v.split('.').nth(1).and_then(|m| m.parse::<u32>().ok()) < Some(44);
        let message = if older {
            format!(
                "client version {v} is too old. Minimum supported API version is {STAND_IN_API}, please upgrade your client to a newer version"
            )
        } else {
            format!(
                "client version {v} is too new. Maximum supported API version is {STAND_IN_API}"
            )
        };
        return answer(
            &mut out,
            "400 Bad Request",
            serde_json::json!({ "message": message }),
        );
    }
    let engine = std::os::unix::net::UnixStream::connect("/var/run/docker.sock")?;
    let mut to_engine = engine.try_clone()?;
    write!(
        to_engine,
        "{method} {path} {proto}\r\n{headers}Connection: close\r\n\r\n"
    )?;
    // The request's body (what the reader holds, then the rest), beside the answer.
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut reader, &mut to_engine);
    });
    let mut from_engine = engine;
    let _ = std::io::copy(&mut from_engine, &mut out);
    let _ = client.shutdown(std::net::Shutdown::Both);
    Ok(())
}

/// A Unix socket in front of the local engine's that passes what the client sends at most
/// `bytes_per_s` (the engine's answers go back at full speed): an engine that reads slowly.
pub struct SlowEngine {
    pub address: EngineAddress,
    _dir: tempfile::TempDir,
}

impl SlowEngine {
    pub fn start(bytes_per_s: u64) -> SlowEngine {
        let dir = crate::tempdir();
        let socket = dir.path().join("engine.sock");
        let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let Ok(engine) = std::os::unix::net::UnixStream::connect("/var/run/docker.sock")
                else {
                    continue;
                };
                let (client_out, engine_in) =
                    (client.try_clone().unwrap(), engine.try_clone().unwrap());
                std::thread::spawn(move || throttled_copy(client, engine_in, bytes_per_s));
                std::thread::spawn(move || {
                    let (mut from, mut to) = (engine, client_out);
                    let _ = std::io::copy(&mut from, &mut to);
                    let _ = to.shutdown(std::net::Shutdown::Write);
                });
            }
        });
        SlowEngine {
            address: EngineAddress {
                host: Some(format!("unix://{}", socket.display())),
                tls: None,
            },
            _dir: dir,
        }
    }
}

/// Copies `from` to `to` in 16 KiB steps, each step waiting until the rate allows it.
fn throttled_copy(
    mut from: std::os::unix::net::UnixStream,
    mut to: std::os::unix::net::UnixStream,
    bytes_per_s: u64,
) {
    use std::io::{Read, Write};
    let begun = std::time::Instant::now();
    let mut sent = 0u64;
    let mut buf = vec![0u8; 16 << 10];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
        sent += n as u64;
        let due = std::time::Duration::from_secs_f64(sent as f64 / bytes_per_s as f64);
        if let Some(wait) = due.checked_sub(begun.elapsed()) {
            std::thread::sleep(wait);
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Write);
}
