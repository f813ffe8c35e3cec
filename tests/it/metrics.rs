//! Tests: metrics. The coordinator's diagnostic listener as an operator uses it: a real
//! Prometheus (Debian's package) scrapes a coordinator serving 20 real agents, its answers are
//! compared with `nodes --json` and the runs' own timestamps, `promtool` checks the exposition
//! and docs/alerts.yml, and an alert fires for an agent killed and kept down past its lease.
use serde_json::Value;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use testkit::agent::{Agent, Coordinator, machine_command, script, wait_until};

const WAIT: Duration = Duration::from_secs(60);

/// One HTTP/1.1 GET (or another method) to `addr`; returns (status, headers, body).
fn http(addr: &str, method: &str, target: &str, headers: &[(&str, &str)]) -> (u16, String, String) {
    let mut stream = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    stream.set_read_timeout(Some(WAIT)).unwrap();
    let mut request =
        format!("{method} {target} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n");
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    stream.write_all(request.as_bytes()).unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").expect("an HTTP answer");
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (status, head.to_string(), body.to_string())
}

fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

/// A Prometheus server on loopback, killed when dropped.
struct Prometheus {
    addr: String,
    child: Child,
}

impl Prometheus {
    /// Scrapes `target` every second and evaluates docs/alerts.yml every second.
    fn start(dir: &Path, target: &str) -> Prometheus {
        let rules = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/alerts.yml");
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\nscrape_configs:\n  - job_name: fleet-coordinator\n    static_configs:\n      - targets: ['{target}']\n",
                rules.canonicalize().unwrap().display()
            ),
        )
        .unwrap();
        let addr = format!("127.0.0.1:{}", free_port());
        let log = std::fs::File::create(dir.join("prometheus.log")).unwrap();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("tsdb").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("Debian's prometheus is installed (cargo xtask ci installs it)");
        let prometheus = Prometheus { addr, child };
        let ready = wait_until(WAIT, || {
            TcpStream::connect(&prometheus.addr).is_ok()
                && http(&prometheus.addr, "GET", "/-/ready", &[]).0 == 200
        });
        assert!(ready, "prometheus never became ready");
        prometheus
    }

    /// An instant query's result vector.
    fn query(&self, promql: &str) -> Vec<Value> {
        let target = format!("/api/v1/query?query={}", url_encode(promql));
        let (status, _, body) = http(&self.addr, "GET", &target, &[]);
        assert_eq!(status, 200, "{promql}: {body}");
        let answer: Value = serde_json::from_str(&body).unwrap();
        answer["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// The single value of an instant query, once it has one.
    fn value(&self, promql: &str) -> Option<f64> {
        let result = self.query(promql);
        let first = result.first()?;
        first["value"][1].as_str()?.parse().ok()
    }

    fn firing(&self, alert: &str) -> bool {
        let (_, _, body) = http(&self.addr, "GET", "/api/v1/alerts", &[]);
        let answer: Value = serde_json::from_str(&body).unwrap();
        (answer["data"]["alerts"].as_array().into_iter().flatten())
            .any(|a| a["labels"]["alertname"] == alert && a["state"] == "firing")
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn url_encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The upper bound of the run-start histogram's bucket that holds `seconds` (its buckets are
/// 50 ms doubling).
fn run_start_bucket(seconds: f64) -> f64 {
    let mut bound = 0.05;
    while bound < seconds {
        bound *= 2.0;
    }
    bound
}

fn joined(coord: &Coordinator) -> Vec<Value> {
    (coord.nodes().into_iter())
        .filter(|n| n["state"] == "Joined")
        .collect()
}

fn status(coord: &Coordinator, set: &str) -> Vec<Value> {
    let out = testkit::ok(coord.command().args(["status", "--set", set, "--json"]));
    serde_json::from_str::<Value>(&out)
        .unwrap()
        .as_array()
        .unwrap()
        .clone()
}

#[test]
fn prometheus_scrapes_twenty_agents_and_an_agent_kept_down_fires_its_alert() {
    const AGENTS: usize = 20;
    let dir = testkit::tempdir();
    let coord = Coordinator::start(
        &dir.path().join("coord"),
        &["--heartbeat", "500ms", "--lease", "3s"],
    );
    let mut agents: Vec<Agent> = (0..AGENTS)
        .map(|i| {
            let machine = dir.path().join(format!("m{i}"));
            std::fs::create_dir_all(&machine).unwrap();
            let name = format!("m{i}");
            std::fs::write(machine.join("fleet.json"), coord.token(&["--name", &name])).unwrap();
            Agent::spawn(&machine.with_extension("log"), machine_command(&machine))
        })
        .collect();
    assert!(
        wait_until(WAIT, || joined(&coord).len() == AGENTS),
        "not every agent joined: {:#?}",
        coord.nodes()
    );
    // Long enough that no run ends (and moves its row on) while the test reads the start times.
    let program = script(&dir.path().join("sleeper.sh"), "sleep 300");
    let set = testkit::ok(
        coord
            .command()
            .args(["run", "--all", "--program"])
            .arg(&program),
    );
    let set = set.trim();
    let mut rows = Vec::new();
    let all_running = wait_until(WAIT, || {
        rows = status(&coord, set);
        rows.len() == AGENTS && rows.iter().all(|r| r["state"] == "running")
    });
    assert!(all_running, "not every run is running: {rows:#?}");

    let metrics = coord.metrics_addr();
    let (status_code, head, exposition) = http(&metrics, "GET", "/metrics", &[]);
    assert_eq!(status_code, 200, "{exposition}");
    assert!(head.contains("text/plain; version=0.0.4"), "{head}");
    let mut promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool is installed with prometheus");
    promtool
        .stdin
        .take()
        .unwrap()
        .write_all(exposition.as_bytes())
        .unwrap();
    let checked = promtool.wait_with_output().unwrap();
    assert!(
        checked.status.success(),
        "promtool check metrics: {}{}\n{exposition}",
        String::from_utf8_lossy(&checked.stdout),
        String::from_utf8_lossy(&checked.stderr)
    );
    let accept = [("accept", "application/openmetrics-text; version=1.0.0")];
    let (_, head, open_metrics) = http(&metrics, "GET", "/metrics", &accept);
    assert!(head.contains("application/openmetrics-text"), "{head}");
    assert!(open_metrics.ends_with("# EOF\n"), "{open_metrics}");
    for secret in [coord.data.display().to_string(), "ed25519:".to_string()] {
        assert!(!exposition.contains(&secret), "the metrics reveal {secret}");
    }

    let prometheus = Prometheus::start(dir.path(), &metrics);
    let expected_joined = joined(&coord).len() as f64;
    let mut seen = None;
    let scraped = wait_until(WAIT, || {
        seen = prometheus.value("max(fleet_nodes{state=\"joined\"})");
        seen == Some(expected_joined)
    });
    assert!(
        scraped,
        "prometheus saw {seen:?} joined, nodes --json says {expected_joined}"
    );

    let mut versions = std::collections::BTreeMap::<String, f64>::new();
    for node in joined(&coord) {
        let version = node["facts"]["agent_version"].as_str().unwrap().to_string();
        *versions.entry(version).or_default() += 1.0;
    }
    let scraped_versions: std::collections::BTreeMap<String, f64> = (prometheus
        .query("fleet_agents"))
    .iter()
    .map(|s| {
        let version = s["metric"]["version"].as_str().unwrap().to_string();
        (version, s["value"][1].as_str().unwrap().parse().unwrap())
    })
    .collect();
    assert_eq!(scraped_versions, versions);

    // The median as Prometheus ranks it (the 10th of 20), from the runs' own timestamps.
    let mut waits: Vec<f64> = (status(&coord, set).iter())
        .map(|r| {
            (r["updated_ms"].as_u64().unwrap() - r["created_ms"].as_u64().unwrap()) as f64 / 1000.0
        })
        .collect();
    waits.sort_by(f64::total_cmp);
    let true_median = waits[AGENTS / 2 - 1];
    assert_eq!(
        prometheus.value("sum(fleet_run_start_seconds_count)"),
        Some(AGENTS as f64)
    );
    let quantile = prometheus
        .value("histogram_quantile(0.5, sum by (le) (fleet_run_start_seconds_bucket))")
        .expect("a run-start quantile");
    assert_eq!(
        run_start_bucket(quantile),
        run_start_bucket(true_median),
        "prometheus' median start {quantile} s and the runs' own {true_median} s ({waits:?}) fall in different buckets"
    );

    assert!(!prometheus.firing("FleetNodeLost"), "no node is lost yet");
    agents[0].kill();
    assert!(
        wait_until(WAIT, || coord.nodes().iter().any(|n| n["state"] == "lost")),
        "the killed agent's node never turned lost"
    );
    assert!(
        wait_until(WAIT, || prometheus.firing("FleetNodeLost")),
        "FleetNodeLost never fired: {}",
        http(&prometheus.addr, "GET", "/api/v1/alerts", &[]).2
    );
}

#[test]
fn the_shipped_alert_rules_pass_promtool() {
    let rules = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/alerts.yml");
    let out = testkit::ok(
        Command::new("promtool")
            .args(["check", "rules"])
            .arg(&rules),
    );
    assert!(out.contains("SUCCESS: 9 rules found"), "{out}");
}

fn token_file(dir: &Path, text: &str, mode: u32) -> std::path::PathBuf {
    let path = dir.join(format!("token-{mode:o}"));
    std::fs::write(&path, text).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
    path
}

/// `serve` with `flags` fails; returns its last stderr line.
fn serve_fails(dir: &Path, flags: &[&str]) -> String {
    let stderr = testkit::fails(
        testkit::cmd("fleet-coordinator")
            .arg("--data")
            .arg(dir.join("coord"))
            .args(["serve", "--listen", "127.0.0.1:0"])
            .args(flags),
    );
    stderr.lines().last().unwrap_or_default().to_string()
}

#[test]
fn off_loopback_the_metrics_need_the_token_and_bad_setups_are_refused_with_a_line() {
    let dir = testkit::tempdir();
    assert_eq!(
        serve_fails(dir.path(), &["--metrics-listen", "0.0.0.0:0"]),
        "fleet-coordinator: the metrics listener 0.0.0.0:0 is reachable off this machine and nothing guards it: give --metrics-auth FILE (a bearer token), or listen on 127.0.0.1"
    );
    let exposed = token_file(dir.path(), "s3cret", 0o644);
    assert_eq!(
        serve_fails(dir.path(), &["--metrics-auth", exposed.to_str().unwrap()]),
        format!(
            "fleet-coordinator: the metrics token file {} can be read by others (mode 644): chmod 600 it",
            exposed.display()
        )
    );
    let empty = token_file(dir.path(), "\n", 0o600);
    assert_eq!(
        serve_fails(dir.path(), &["--metrics-auth", empty.to_str().unwrap()]),
        format!(
            "fleet-coordinator: the metrics token file {} is empty: write a long random token into it",
            empty.display()
        )
    );
    let missing = dir.path().join("no-such-token");
    assert_eq!(
        serve_fails(dir.path(), &["--metrics-auth", missing.to_str().unwrap()]),
        format!(
            "fleet-coordinator: cannot read the metrics token file {}: No such file or directory (os error 2); write the token into it (chmod 600)",
            missing.display()
        )
    );
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = taken.local_addr().unwrap().to_string();
    assert_eq!(
        serve_fails(dir.path(), &["--metrics-listen", &taken]),
        format!(
            "fleet-coordinator: cannot listen for metrics on {taken}: Address already in use (os error 98); pass --metrics-listen with a free address, or off"
        )
    );

    let token = token_file(dir.path(), "s3cret\n", 0o600);
    let coord = Coordinator::start(
        &dir.path().join("coord"),
        &[
            "--metrics-listen",
            "0.0.0.0:0",
            "--metrics-auth",
            token.to_str().unwrap(),
        ],
    );
    let bound = coord.metrics_addr();
    let port = bound.rsplit(':').next().unwrap();
    let addr = format!("127.0.0.1:{port}");
    let (status, head, body) = http(&addr, "GET", "/metrics", &[]);
    assert_eq!(status, 401, "{body}");
    assert!(
        head.to_ascii_lowercase()
            .contains("www-authenticate: bearer"),
        "{head}"
    );
    let wrong = [("authorization", "Bearer s3cre")];
    assert_eq!(http(&addr, "GET", "/metrics", &wrong).0, 401);
    let right = [("authorization", "Bearer s3cret")];
    let (status, _, body) = http(&addr, "GET", "/metrics", &right);
    assert_eq!(status, 200);
    assert!(body.contains("\nfleet_sessions 0\n"), "{body}");
    assert!(!body.contains("s3cret"));
    let (status, _, body) = http(&addr, "GET", "/metrics?%ff%zz=&&=garbage", &right);
    assert_eq!(status, 200, "a query string is ignored: {body}");
    let (status, _, body) = http(&addr, "GET", "/healthz", &[]);
    assert_eq!((status, body.as_str()), (200, "ok\n"), "no token needed");
    // Ready once serving takes sessions; until then (its first moments) it says why not.
    let mut answers = Vec::new();
    let ready = wait_until(Duration::from_secs(10), || {
        let (status, _, body) = http(&addr, "GET", "/readyz", &[]);
        answers.push((status, body));
        status == 200
    });
    assert!(ready, "never ready: {answers:?}");
    let starting = "not ready: the coordinator does not take sessions now (starting or stopping)\n";
    for (status, body) in &answers {
        match status {
            200 => assert_eq!(body, "ready\n"),
            _ => assert_eq!((*status, body.as_str()), (503, starting)),
        }
    }
    let (status, _, body) = http(&addr, "GET", "/nodes/../../etc", &right);
    assert_eq!((status, body.as_str()), (404, "no page /nodes/../../etc\n"));
    for page in ["/", "/nodes", "/events?view=%2F"] {
        assert_eq!(
            http(&addr, "GET", page, &[]).0,
            401,
            "{page} without the token"
        );
    }
    let (status, _, body) = http(&addr, "GET", "/nodes?page=x", &right);
    assert_eq!((status, body.as_str()), (400, "page is a number from 1\n"));
    let (status, _, body) = http(&addr, "GET", "/nodes?state=%zz", &right);
    assert_eq!(
        (status, body.as_str()),
        (400, "\"%zz\" has a % not followed by two hex digits\n")
    );
    let (status, _, body) = http(&addr, "GET", "/sets/s-000000000000", &right);
    assert_eq!(
        (status, body.as_str()),
        (
            404,
            "no set s-000000000000: it never existed or was pruned\n"
        )
    );
    let (status, _, body) = http(&addr, "GET", "/runs/r-000000000000", &right);
    assert_eq!(status, 404, "{body}");
    let (status, head, body) = http(&addr, "GET", "/", &right);
    assert_eq!(status, 200, "{body}");
    assert!(head.contains("text/html"), "{head}");
    assert!(body.contains("<b id=\"count-joined\">0</b>"), "{body}");
    assert_eq!(http(&addr, "POST", "/metrics", &right).0, 405);
}
