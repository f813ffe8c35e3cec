//! `docker_api`: the Docker Engine's answers as the agent's Docker runtime reads them. A stand-in
//! engine on a Unix socket answers every request from the input; the agent's own
//! [`DockerRuntime`] connects to it (version negotiation, the event stream) and asks for a run's
//! state, the list of its runs, a collect, a start (create, pull, start), a stop and a tidy.
//!
//! The input: one status selector per endpoint (a digit each: `0` the endpoint's success, `1`
//! 404, `2` 409, `3` 500, `4` 304, `5` 400), then, each after [`SEP`], the bodies of `/version`,
//! a container's inspect, its logs, `/events`, the container list, the archive stat (JSON, sent
//! base64 in its header as the engine does), the archive (tar), the create, the pull's progress,
//! the start, the stop, the remove, and the error body every refused request gets.
//!
//! Properties: no answer makes the runtime panic or hang; a state read is the run's own, and its
//! output ends are consistent (kept at most what was written, the last KiB at most); a collect
//! wrote exactly the bytes it reports, at most the limit, hashing to the digest it reports.
use crate::support::{fresh_dir, sections};
use base64::Engine as _;
use fleet_agent::runtime::docker::{DockerRuntime, EngineAddress};
use fleet_agent::runtime::{Changes, RunSpec, RunStatus, Runtime, Workload};
use fleet_proto::RunId;
use fleet_proto::run::{ImageRef, RegistryAuth};
use sha2::Digest as _;
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

/// Between the parts of an input (JSON, tar and log streams never hold it).
pub const SEP: &[u8] = b"\n\x00--\x00\n";

const RUN: &str = "fuzz";
const AGENT: &str = "fuzz-agent";
const COLLECT_LIMIT: u64 = 1 << 20;

/// The endpoints the stand-in answers, in the input's order.
#[derive(Clone, Copy)]
enum Endpoint {
    Version,
    Inspect,
    Logs,
    Events,
    List,
    Stat,
    Archive,
    Create,
    Pull,
    Start,
    Stop,
    Remove,
}

const ENDPOINTS: usize = 12;

/// What the stand-in engine answers, from one input.
struct Answers {
    statuses: [u16; ENDPOINTS],
    bodies: [Vec<u8>; ENDPOINTS],
    error: Vec<u8>,
}

impl Answers {
    fn of(data: &[u8]) -> Answers {
        let parts = sections::<14>(data, SEP);
        let mut statuses = [0; ENDPOINTS];
        for (n, status) in statuses.iter_mut().enumerate() {
            let success = match n {
                n if n == Endpoint::Create as usize => 201,
                n if [Endpoint::Start, Endpoint::Stop, Endpoint::Remove]
                    .iter()
                    .any(|e| *e as usize == n) =>
                {
                    204
                }
                _ => 200,
            };
            *status = match parts[0].get(n).map(|b| b % 6) {
                None | Some(0) => success,
                Some(1) => 404,
                Some(2) => 409,
                Some(3) => 500,
                Some(4) => 304,
                _ => 400,
            };
        }
        Answers {
            statuses,
            bodies: std::array::from_fn(|n| parts[n + 1].to_vec()),
            error: parts[13].to_vec(),
        }
    }
}

/// The stand-in engine: one per process, answering from the current input.
struct Engine {
    socket: PathBuf,
    answers: Arc<Mutex<Option<Arc<Answers>>>>,
    /// One input at a time talks to it.
    turn: Mutex<()>,
}

fn engine() -> &'static Engine {
    static ENGINE: OnceLock<Engine> = OnceLock::new();
    ENGINE.get_or_init(|| {
        let dir = tempfile::Builder::new()
            .prefix("fuzz-targets-engine.")
            .tempdir()
            .expect("a folder for the engine's socket")
            .keep();
        let socket = dir.join("docker.sock");
        let listener = UnixListener::bind(&socket).expect("the engine's socket");
        let answers: Arc<Mutex<Option<Arc<Answers>>>> = Arc::default();
        // A few threads that live as long as the process serve the connections (a thread per
        // connection would cost more than the answers, under a sanitizer); more than one, so
        // the event stream's request waits on no other.
        let (to_serve, queue) = std::sync::mpsc::channel::<(UnixStream, Arc<Answers>)>();
        let queue = Arc::new(Mutex::new(queue));
        for n in 0..4 {
            let queue = queue.clone();
            std::thread::Builder::new()
                .name(format!("fake-engine-{n}"))
                .spawn(move || {
                    loop {
                        let next = queue.lock().unwrap_or_else(|p| p.into_inner()).recv();
                        let Ok((conn, answers)) = next else { return };
                        serve(conn, &answers);
                    }
                })
                .expect("the engine's threads");
        }
        let serving = answers.clone();
        std::thread::Builder::new()
            .name("fake-engine".into())
            .spawn(move || {
                for conn in listener.incoming().flatten() {
                    let current = serving.lock().unwrap_or_else(|p| p.into_inner()).clone();
                    if let Some(answers) = current {
                        let _ = to_serve.send((conn, answers));
                    }
                }
            })
            .expect("the engine's thread");
        Engine {
            socket,
            answers,
            turn: Mutex::new(()),
        }
    })
}

/// Answers one request on `conn`, then closes it.
fn serve(mut conn: UnixStream, answers: &Answers) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match conn.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            _ => return,
        }
        if head.len() > 64 << 10 {
            return;
        }
    }
    let head = String::from_utf8_lossy(&head).to_string();
    let mut lines = head.lines();
    let mut first = lines.next().unwrap_or_default().split(' ');
    let (method, target) = (first.next().unwrap_or(""), first.next().unwrap_or("/"));
    let length: usize = lines
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.trim().parse().ok())
        .unwrap_or(0);
    let mut body = vec![0; length.min(1 << 20)];
    if conn.read_exact(&mut body).is_err() {
        return;
    }
    let path = target.split('?').next().unwrap_or("/");
    // The client speaks `/v1.NN/...`; the version is not the stand-in's business.
    let path = match path.strip_prefix("/v1.") {
        Some(rest) => rest.find('/').map_or("/", |i| &rest[i..]),
        None => path,
    };
    let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
    let endpoint = match (method, parts.as_slice()) {
        (_, ["_ping"]) => None,
        ("GET", ["version"]) => Some(Endpoint::Version),
        ("GET", ["events"]) => Some(Endpoint::Events),
        ("GET", ["containers", "json"]) => Some(Endpoint::List),
        ("POST", ["containers", "create"]) => Some(Endpoint::Create),
        ("POST", ["images", "create"]) => Some(Endpoint::Pull),
        ("GET", ["containers", _, "json"]) => Some(Endpoint::Inspect),
        ("GET", ["containers", _, "logs"]) => Some(Endpoint::Logs),
        ("HEAD", ["containers", _, "archive"]) => Some(Endpoint::Stat),
        ("GET", ["containers", _, "archive"]) => Some(Endpoint::Archive),
        ("POST", ["containers", _, "start"]) => Some(Endpoint::Start),
        ("POST", ["containers", _, "stop"]) => Some(Endpoint::Stop),
        ("DELETE", ["containers", _]) => Some(Endpoint::Remove),
        _ => {
            answer(
                &mut conn,
                method,
                404,
                &[],
                br#"{"message":"page not found"}"#,
            );
            return;
        }
    };
    let Some(endpoint) = endpoint else {
        answer(&mut conn, method, 200, &[], b"OK");
        return;
    };
    let n = endpoint as usize;
    let status = answers.statuses[n];
    if !(200..300).contains(&status) && status != 304 {
        answer(&mut conn, method, status, &[], &answers.error);
        return;
    }
    let body = &answers.bodies[n];
    match endpoint {
        Endpoint::Stat => {
            let stat = base64::engine::general_purpose::STANDARD.encode(body);
            answer(
                &mut conn,
                method,
                status,
                &[("X-Docker-Container-Path-Stat", &stat)],
                b"",
            );
        }
        _ => answer(&mut conn, method, status, &[], body),
    }
}

fn answer(conn: &mut UnixStream, method: &str, status: u16, headers: &[(&str, &str)], body: &[u8]) {
    let mut out = format!("HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n");
    for (k, v) in headers {
        out.push_str(&format!("{k}: {v}\r\n"));
    }
    // 204 and 304 carry no body.
    let body = if method == "HEAD" || status == 204 || status == 304 {
        &[][..]
    } else {
        body
    };
    if status != 204 && status != 304 {
        out.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    out.push_str("Connection: close\r\n\r\n");
    let _ = conn.write_all(out.as_bytes());
    let _ = conn.write_all(body);
    let _ = conn.flush();
    let _ = conn.shutdown(std::net::Shutdown::Both);
}

pub fn docker_api(data: &[u8]) {
    let engine = engine();
    let _turn = engine.turn.lock().unwrap_or_else(|p| p.into_inner());
    *engine.answers.lock().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(Answers::of(data)));
    let marks = fresh_dir("docker_api-marks");
    let address = EngineAddress {
        host: Some(format!("unix://{}", engine.socket.display())),
        tls: None,
    };
    let changes = Changes::default();
    let runtime = match DockerRuntime::connect(&address, &marks, AGENT, changes) {
        Ok(runtime) => runtime,
        Err(e) => {
            assert!(!e.to_string().is_empty());
            return;
        }
    };
    let id = RunId::parse(RUN).expect("a run id");
    if let Ok(status) = runtime.status(&id) {
        assert_eq!(status.run_id, RUN, "a state read is the run's own");
        consistent(&status);
    }
    if let Ok(runs) = runtime.list() {
        for status in &runs {
            consistent(status);
        }
    }
    let mut sink = Vec::new();
    match runtime.collect(&id, "out/result.txt", COLLECT_LIMIT, &mut sink) {
        Ok(collected) => {
            assert!(collected.size <= COLLECT_LIMIT);
            assert_eq!(
                collected.size,
                sink.len() as u64,
                "a collect reports what it wrote"
            );
            let digest = format!("sha256:{}", hex::encode(sha2::Sha256::digest(&sink)));
            assert_eq!(collected.digest.to_string(), digest);
        }
        Err(e) => assert!(!e.to_string().is_empty()),
    }
    assert!(
        sink.len() as u64 <= COLLECT_LIMIT,
        "a collect wrote past its limit"
    );
    let image = ImageRef::parse(&format!("registry.test/fuzz@sha256:{}", "ab".repeat(32)))
        .expect("an image name");
    let mut spec = RunSpec::new(id.clone(), Workload::Image(image));
    spec.timeout = Some(Duration::from_secs(3600));
    spec.registry_auth = Some(RegistryAuth {
        username: "fuzz".into(),
        password: "secret".into(),
    });
    if let Err(e) = runtime.start(&spec) {
        assert!(
            !e.to_string().contains("secret"),
            "an error shows the registry password"
        );
    }
    let _ = runtime.stop(&id);
    let _ = runtime.tidy(&|_| None);
    drop(runtime);
}

fn consistent(status: &RunStatus) {
    serde_json::to_vec(&status.report).expect("a report serializes");
    let Some(outcome) = &status.report.outcome else {
        return;
    };
    for end in [&outcome.stdout, &outcome.stderr].into_iter().flatten() {
        assert!(end.kept <= end.bytes);
        assert_eq!(end.truncated, end.kept < end.bytes);
        assert!(end.last.0.len() <= 1024 && end.last.0.len() as u64 <= end.bytes);
    }
}
