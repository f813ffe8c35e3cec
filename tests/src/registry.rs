//! A real `docker-registry` (distribution 2.8) on a free loopback port: plain, TLS with clientcas, htpasswd.
use crate::pki::Pki;
use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How a registry is started.
#[derive(Default)]
pub struct Options<'a> {
    /// Serve TLS with the PKI's server certificate and require a client certificate signed by its CA.
    pub tls: Option<&'a Pki>,
    /// Require basic auth for this user and password (an htpasswd file with a bcrypt hash).
    pub user: Option<(&'a str, &'a str)>,
    /// Require bearer tokens from this token server.
    pub token: Option<&'a TokenServer>,
}

/// A running registry, killed and its storage removed when dropped.
pub struct Registry {
    child: Child,
    dir: tempfile::TempDir,
    pub addr: SocketAddr,
}

impl Registry {
    /// A registry over plain HTTP without auth.
    pub fn plain() -> Registry {
        Registry::start(Options::default())
    }

    /// A registry over TLS that refuses clients without a certificate signed by the PKI's CA.
    pub fn tls(pki: &Pki) -> Registry {
        Registry::start(Options {
            tls: Some(pki),
            ..Options::default()
        })
    }

    pub fn start(options: Options) -> Registry {
        // A free port can be taken by another process before the registry binds it (tests run
        // side by side): then it is started again on another.
        const TRIES: usize = 5;
        for _ in 0..TRIES {
            match Registry::launch(&options) {
                Ok(registry) => return registry,
                Err(log) if log.contains("address already in use") => continue,
                Err(log) => panic!("docker-registry exited:\n{log}"),
            }
        }
        panic!("docker-registry found its port taken {TRIES} times in a row")
    }

    /// Starts the registry on a free port; `Err` with its log when it exits before it listens.
    fn launch(options: &Options) -> Result<Registry, String> {
        let dir = crate::tempdir();
        let port = free_port();
        let addr: SocketAddr = format!("127.0.0.1:{port}")
            .parse()
            .expect("a loopback address");
        let config = config(dir.path(), addr, options);
        std::fs::write(dir.path().join("config.yml"), config)
            .expect("can write the registry config");
        let log =
            std::fs::File::create(dir.path().join("registry.log")).expect("can create the log");
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(dir.path().join("config.yml"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("can share the log file"))
            .stderr(log)
            .spawn()
            .expect("docker-registry is installed (cargo xtask ci installs it)");
        let mut registry = Registry { child, dir, addr };
        registry.wait_listening()?;
        Ok(registry)
    }

    /// `127.0.0.1:PORT`, the host part of a `docker://` reference.
    pub fn host(&self) -> String {
        self.addr.to_string()
    }

    /// `docker://127.0.0.1:PORT/REPO`.
    pub fn image(&self, repo_and_tag: &str) -> String {
        format!("docker://{}/{repo_and_tag}", self.host())
    }

    /// Everything the registry logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).expect("can read the registry log")
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("registry.log")
    }

    /// The access-log request lines (`"METHOD URI HTTP/1.1" STATUS`) logged so far.
    pub fn requests(&self) -> Vec<String> {
        self.log()
            .lines()
            .filter(|l| l.starts_with("127.0.0.1 - "))
            .filter_map(|l| {
                let start = l.find('"')? + 1;
                let end = start + l[start..].find('"')?;
                let status = l[end + 1..].split_whitespace().next().unwrap_or("");
                Some(format!("{} {status}", &l[start..end]))
            })
            .collect()
    }

    /// How many requests carried blob bytes (PATCH or PUT to an upload) so far.
    pub fn blob_uploads(&self) -> usize {
        self.requests()
            .iter()
            .filter(|r| {
                (r.starts_with("PUT ") || r.starts_with("PATCH ")) && r.contains("/blobs/uploads/")
            })
            .count()
    }

    /// How many requests matched a prefix such as `"PUT /v2/app/manifests/"`.
    pub fn count(&self, prefix: &str) -> usize {
        self.requests()
            .iter()
            .filter(|r| r.starts_with(prefix))
            .count()
    }

    /// The registry's storage folder (docker/registry/v2/...).
    pub fn storage(&self) -> PathBuf {
        self.dir.path().join("storage")
    }

    /// Waits until this registry says it listens on its address and answers there (another
    /// process on the port would answer too); `Err` with its log when it exits first.
    fn wait_listening(&mut self) -> Result<(), String> {
        let said = format!("listening on {}", self.addr);
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!("exit {status}:\n{}", self.log()));
            }
            if self.log().contains(&said)
                && TcpStream::connect_timeout(&self.addr, Duration::from_millis(200)).is_ok()
            {
                return Ok(());
            }
            // Polling pace, not a wait for time.
            std::thread::sleep(Duration::from_millis(25));
        }
        panic!(
            "docker-registry did not listen on {} within 60 s:\n{}",
            self.addr,
            self.log()
        );
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A port that was free a moment ago (the registry binds it itself).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("can bind a loopback port")
        .port()
}

fn config(dir: &Path, addr: SocketAddr, options: &Options) -> String {
    let mut c = format!(
        "version: 0.1\nlog:\n  level: info\n  formatter: text\nstorage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\nhttp:\n  addr: {addr}\n",
        dir.join("storage").display()
    );
    if let Some(pki) = options.tls {
        c += &format!(
            "  tls:\n    certificate: {}\n    key: {}\n    clientcas:\n      - {}\n",
            pki.server_cert.display(),
            pki.server_key.display(),
            pki.ca_cert.display()
        );
    }
    if let Some((user, password)) = options.user {
        let hash = bcrypt::hash(password, 4).expect("can hash a password");
        let path = dir.join("htpasswd");
        let mut f = std::fs::File::create(&path).expect("can create htpasswd");
        writeln!(f, "{user}:{hash}").expect("can write htpasswd");
        c += &format!(
            "auth:\n  htpasswd:\n    realm: fleet-test\n    path: {}\n",
            path.display()
        );
    }
    if let Some(t) = options.token {
        c += &format!(
            "auth:\n  token:\n    realm: http://{}/token\n    service: {TOKEN_SERVICE}\n    issuer: {TOKEN_ISSUER}\n    rootcertbundle: {}\n",
            t.addr,
            t.cert.display()
        );
    }
    c
}

/// A canned answer the fault proxy gives instead of forwarding a request.
#[derive(Clone, Debug)]
pub struct Fault {
    /// The request method it applies to (`PUT`, `POST`...), or `*` for any.
    pub method: &'static str,
    /// A substring of the request path it applies to.
    pub path: &'static str,
    /// The status to answer.
    pub status: u16,
    /// How many matching requests get it (later ones are forwarded).
    pub times: usize,
    /// Extra response headers.
    pub headers: Vec<(&'static str, &'static str)>,
    /// Instead of answering, forward the request without its query (a registry that ignores `?mount=`).
    pub drop_query: bool,
}

impl Fault {
    /// Answers `status` to the first `times` requests of `method` whose path holds `path`.
    pub fn new(method: &'static str, path: &'static str, status: u16, times: usize) -> Fault {
        Fault {
            method,
            path,
            status,
            times,
            headers: vec![],
            drop_query: false,
        }
    }
}

/// A loopback HTTP proxy in front of a plain registry that answers some requests with faults
/// (403, 413, 415, 429, 503...) and forwards the rest, one request per connection.
pub struct FaultProxy {
    pub addr: SocketAddr,
    faults: std::sync::Arc<std::sync::Mutex<Vec<Fault>>>,
    injected: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    _loopback: Loopback,
}

impl FaultProxy {
    pub fn start(upstream: SocketAddr, faults: Vec<Fault>) -> FaultProxy {
        use std::sync::atomic::AtomicUsize;
        use std::sync::{Arc, Mutex};
        let faults = Arc::new(Mutex::new(faults));
        let injected = Arc::new(AtomicUsize::new(0));
        let (f, i) = (faults.clone(), injected.clone());
        let loopback = Loopback::serve(move |conn| proxy_one(conn, upstream, &f, &i));
        FaultProxy {
            addr: loopback.addr,
            faults,
            injected,
            _loopback: loopback,
        }
    }

    /// `127.0.0.1:PORT` of the proxy.
    pub fn host(&self) -> String {
        self.addr.to_string()
    }

    /// `docker://127.0.0.1:PORT/REPO` through the proxy.
    pub fn image(&self, repo_and_tag: &str) -> String {
        format!("docker://{}/{repo_and_tag}", self.host())
    }

    /// How many faults were answered so far.
    pub fn injected(&self) -> usize {
        self.injected.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Faults still armed.
    pub fn armed(&self) -> usize {
        self.faults
            .lock()
            .expect("not poisoned")
            .iter()
            .map(|f| f.times)
            .sum()
    }
}

/// A loopback listener that serves each connection on a thread of its own (the proxies here
/// take one request per connection); it stops accepting when dropped.
pub(crate) struct Loopback {
    pub(crate) addr: SocketAddr,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Loopback {
    /// Listens on `127.0.0.1:0` and hands every connection to `serve`.
    pub(crate) fn serve<F>(serve: F) -> Loopback
    where
        F: Fn(TcpStream) -> std::io::Result<()> + Send + Sync + 'static,
    {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicBool, Ordering};
        let listener = TcpListener::bind("127.0.0.1:0").expect("can bind a loopback port");
        let addr = listener
            .local_addr()
            .expect("a bound listener has an address");
        let stop = Arc::new(AtomicBool::new(false));
        let (s, serve) = (stop.clone(), Arc::new(serve));
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if s.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(conn) = conn else { continue };
                let serve = serve.clone();
                std::thread::spawn(move || {
                    let _ = serve(conn);
                });
            }
        });
        Loopback { addr, stop }
    }
}

impl Drop for Loopback {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let _ = TcpStream::connect(self.addr);
    }
}

/// The head of one HTTP/1.1 request a proxy here read from its client.
pub(crate) struct RequestHead {
    /// The request line and the header lines, each with its CRLF (the blank line left out).
    pub(crate) lines: Vec<String>,
    pub(crate) method: String,
    /// The request target as sent: path and query.
    pub(crate) path: String,
    /// Its `Content-Length`, 0 when absent.
    pub(crate) length: u64,
}

impl RequestHead {
    /// Reads a request head; `None` when the client closed before sending a whole one.
    pub(crate) fn read(reader: &mut impl std::io::BufRead) -> std::io::Result<Option<RequestHead>> {
        let mut lines = Vec::new();
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line)? == 0 {
                return Ok(None);
            }
            if line == "\r\n" {
                if lines.is_empty() {
                    // A stray CRLF before the request line, which HTTP/1.1 lets a server skip.
                    continue;
                }
                break;
            }
            lines.push(line);
        }
        let mut parts = lines.first().map_or("", String::as_str).split_whitespace();
        let (method, path) = (
            parts.next().unwrap_or("").to_string(),
            parts.next().unwrap_or("").to_string(),
        );
        let length = lines
            .iter()
            .find_map(|h| {
                let (k, v) = h.split_once(':')?;
                k.eq_ignore_ascii_case("content-length")
                    .then(|| v.trim().parse().ok())?
            })
            .unwrap_or(0);
        Ok(Some(RequestHead {
            lines,
            method,
            path,
            length,
        }))
    }

    /// Sends this request to `upstream` with `request_line` in place of its own (the same, or
    /// rewritten), its headers with `Connection: close`, and `body`; returns the connection its
    /// answer comes back on.
    pub(crate) fn forward(
        &self,
        upstream: SocketAddr,
        request_line: &str,
        body: &mut impl std::io::Read,
    ) -> std::io::Result<TcpStream> {
        let mut up = TcpStream::connect(upstream)?;
        let mut out = request_line.to_string();
        for h in self.lines.iter().skip(1) {
            if !h.to_ascii_lowercase().starts_with("connection:") {
                out += h;
            }
        }
        out += "Connection: close\r\n\r\n";
        up.write_all(out.as_bytes())?;
        std::io::copy(body, &mut up)?;
        Ok(up)
    }
}

fn proxy_one(
    mut client: TcpStream,
    upstream: SocketAddr,
    faults: &std::sync::Mutex<Vec<Fault>>,
    injected: &std::sync::atomic::AtomicUsize,
) -> std::io::Result<()> {
    use std::io::{BufReader, Read};
    let mut reader = BufReader::new(client.try_clone()?);
    let Some(head) = RequestHead::read(&mut reader)? else {
        return Ok(());
    };
    let (method, path, length) = (&head.method, &head.path, head.length);
    let fault = {
        let mut faults = faults.lock().expect("not poisoned");
        faults
            .iter_mut()
            .find(|f| {
                f.times > 0 && (f.method == "*" || f.method == method) && path.contains(f.path)
            })
            .map(|f| {
                f.times -= 1;
                f.clone()
            })
    };
    let mut request_line = head.lines[0].clone();
    if fault.as_ref().is_some_and(|f| f.drop_query) {
        injected.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let bare = path.split('?').next().unwrap_or(path).to_string();
        request_line = request_line.replacen(path, &bare, 1);
    } else if let Some(f) = fault {
        injected.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        std::io::copy(&mut (&mut reader).take(length), &mut std::io::sink())?;
        let mut resp = format!(
            "HTTP/1.1 {} Fault\r\nContent-Length: 0\r\nConnection: close\r\n",
            f.status
        );
        for (k, v) in &f.headers {
            resp += &format!("{k}: {v}\r\n");
        }
        resp += "\r\n";
        client.write_all(resp.as_bytes())?;
        return Ok(());
    }
    let mut up = head.forward(upstream, &request_line, &mut (&mut reader).take(length))?;
    std::io::copy(&mut up, &mut client)?;
    Ok(())
}

const TOKEN_SERVICE: &str = "fleet-registry";
const TOKEN_ISSUER: &str = "fleet-token-issuer";

/// A small bearer token server (the `auth: token` kind distribution uses): it checks Basic
/// credentials, grants each user its allowed actions, and signs RS256 JWTs with openssl.
pub struct TokenServer {
    pub addr: SocketAddr,
    cert: PathBuf,
    requests: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    _dir: tempfile::TempDir,
}

/// A user of the token server: name, password, and the actions granted on every repository.
pub type Grant = (&'static str, &'static str, &'static [&'static str]);

impl TokenServer {
    pub fn start(users: Vec<Grant>) -> TokenServer {
        let dir = crate::tempdir();
        let (key, cert) = (dir.path().join("token.key"), dir.path().join("token.crt"));
        crate::ok(
            Command::new("openssl")
                .args([
                    "req",
                    "-x509",
                    "-newkey",
                    "rsa:2048",
                    "-nodes",
                    "-days",
                    "2",
                    "-subj",
                    "/CN=fleet token signer",
                ])
                .arg("-keyout")
                .arg(&key)
                .arg("-out")
                .arg(&cert),
        );
        let der = crate::output(
            Command::new("openssl")
                .args(["x509", "-outform", "DER", "-in"])
                .arg(&cert),
        )
        .stdout;
        let x5c = base64::Engine::encode(&base64::engine::general_purpose::STANDARD, der);
        let listener = TcpListener::bind("127.0.0.1:0").expect("can bind a loopback port");
        let addr = listener
            .local_addr()
            .expect("a bound listener has an address");
        let requests = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let log = requests.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let _ = serve_token(conn, &users, &key, &x5c, &log);
            }
        });
        TokenServer {
            addr,
            cert,
            requests,
            _dir: dir,
        }
    }

    /// The query strings of every token request so far (scopes, service).
    pub fn requests(&self) -> Vec<String> {
        self.requests.lock().expect("not poisoned").clone()
    }
}

fn serve_token(
    mut conn: TcpStream,
    users: &[Grant],
    key: &Path,
    x5c: &str,
    log: &std::sync::Mutex<Vec<String>>,
) -> std::io::Result<()> {
    use base64::Engine as _;
    use std::io::{BufRead, BufReader};
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut request = String::new();
    reader.read_line(&mut request)?;
    let mut basic = None;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 || line == "\r\n" {
            break;
        }
        if let Some((k, v)) = line.split_once(':')
            && k.eq_ignore_ascii_case("authorization")
        {
            basic = v.trim().strip_prefix("Basic ").map(str::to_string);
        }
    }
    let query = request
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.split_once('?'))
        .map(|(_, q)| q.to_string())
        .unwrap_or_default();
    log.lock().expect("not poisoned").push(
        query
            .replace("%3A", ":")
            .replace("%2C", ",")
            .replace("%2F", "/"),
    );
    let user = basic
        .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b).ok())
        .and_then(|raw| String::from_utf8(raw).ok())
        .and_then(|up| {
            users
                .iter()
                .find(|(u, p, _)| up == format!("{u}:{p}"))
                .copied()
        });
    let Some((name, _, allowed)) = user else {
        conn.write_all(
            b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        )?;
        return Ok(());
    };
    let mut access = Vec::new();
    for scope in query.split('&').filter_map(|kv| kv.strip_prefix("scope=")) {
        let scope = scope
            .replace("%3A", ":")
            .replace("%2C", ",")
            .replace("%2F", "/");
        let mut parts = scope.splitn(3, ':');
        let (kind, repo, actions) = (
            parts.next().unwrap_or(""),
            parts.next().unwrap_or(""),
            parts.next().unwrap_or(""),
        );
        let granted: Vec<&str> = actions.split(',').filter(|a| allowed.contains(a)).collect();
        access.push(serde_json::json!({"type": kind, "name": repo, "actions": granted}));
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_secs();
    let header = serde_json::json!({"typ": "JWT", "alg": "RS256", "x5c": [x5c]});
    let claims = serde_json::json!({
        "iss": TOKEN_ISSUER, "sub": name, "aud": TOKEN_SERVICE,
        "exp": now + 600, "nbf": now - 60, "iat": now, "jti": format!("{now}-{}", access.len()),
        "access": access,
    });
    let signing_input = format!(
        "{}.{}",
        b64.encode(header.to_string()),
        b64.encode(claims.to_string())
    );
    let mut openssl = Command::new("openssl")
        .args(["dgst", "-sha256", "-sign"])
        .arg(key)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    openssl
        .stdin
        .take()
        .expect("piped")
        .write_all(signing_input.as_bytes())?;
    let signature = openssl.wait_with_output()?.stdout;
    let token = format!("{signing_input}.{}", b64.encode(signature));
    let body = serde_json::json!({"token": token, "expires_in": 600}).to_string();
    let resp = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(resp.as_bytes())
}
