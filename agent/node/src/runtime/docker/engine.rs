//! Reaching the engine: the local socket by default, plain TCP, or TLS with a client
//! certificate, where the server is trusted only through the given CA (as `docker --tlsverify`
//! does; bollard's own TLS client would also trust the system's roots, so ours is used).
use super::RuntimeError;
use bollard::{API_DEFAULT_VERSION, BollardRequest, Docker};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Seconds any one engine request may take before it is given up (a stop waits out its grace
/// inside one request, so this is long).
const REQUEST_TIMEOUT_S: u64 = 600;
/// The local engine's socket, used when no host is given.
pub const LOCAL_SOCKET: &str = "unix:///var/run/docker.sock";

/// Where the engine is: `unix:///path`, `tcp://HOST:PORT` or `https://HOST:PORT`, with the
/// files of a mutual TLS connection.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineAddress {
    /// `None`: the local socket, `/var/run/docker.sock`.
    pub host: Option<String>,
    pub tls: Option<TlsFiles>,
}

/// The client's certificate and key (both or neither: an engine that asks for none), and the
/// only CA the server is trusted through.
#[derive(Debug, Clone, PartialEq)]
pub struct TlsFiles {
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    pub ca: PathBuf,
}

impl EngineAddress {
    /// Docker's own convention: `DOCKER_HOST`, and with `DOCKER_TLS_VERIFY` set (non-empty),
    /// `ca.pem`, `cert.pem` and `key.pem` in `DOCKER_CERT_PATH` (default `~/.docker`).
    pub fn from_env() -> EngineAddress {
        let var = |name| std::env::var(name).ok().filter(|v: &String| !v.is_empty());
        let tls = var("DOCKER_TLS_VERIFY").map(|_| {
            let dir = var("DOCKER_CERT_PATH")
                .map(PathBuf::from)
                .unwrap_or_else(|| Path::new(&var("HOME").unwrap_or_default()).join(".docker"));
            TlsFiles {
                cert: Some(dir.join("cert.pem")),
                key: Some(dir.join("key.pem")),
                ca: dir.join("ca.pem"),
            }
        });
        EngineAddress {
            host: var("DOCKER_HOST"),
            tls,
        }
    }

    /// The address as a person reads it.
    pub fn describe(&self) -> String {
        self.host
            .clone()
            .unwrap_or_else(|| LOCAL_SOCKET.to_string())
    }
}

/// The engine's own version and the API version it answers this client at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineVersion {
    pub version: String,
    pub api: String,
}

impl std::fmt::Display for EngineVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (API {})", self.version, self.api)
    }
}

/// Connects, negotiates the API version, and returns the client with the engine's version.
pub(super) async fn connect(
    address: &EngineAddress,
) -> Result<(Docker, EngineVersion), RuntimeError> {
    let at = address.describe();
    let failed = |reason: String| RuntimeError::Failed {
        what: format!("reaching the Docker engine at {at}"),
        reason,
    };
    let docker = client(address).map_err(&failed)?;
    let docker = match docker.negotiate_version().await {
        Ok(docker) => docker,
        Err(e) => {
            let reason = match &address.tls {
                Some(files) => tls_reason(&e, host_port(address), files).await,
                None => super::describe(&e),
            };
            return Err(failed(format!(
                "{reason}; start the engine or pass --docker-host"
            )));
        }
    };
    let docker = speaking(docker, None);
    let version = docker
        .version()
        .await
        .map_err(|e| failed(super::describe(&e)))?;
    let described = EngineVersion {
        version: version.version.unwrap_or_default(),
        api: docker.client_version().to_string(),
    };
    Ok((docker, described))
}

/// The client with every request's path at its negotiated API version (`/v1.41/...`), as the
/// `docker` CLI asks, so the engine answers at that version rather than at its own newest
/// (bollard sends the path bare), and with `header` on every request when one is given.
pub(super) fn speaking(
    docker: Docker,
    header: Option<(&'static str, http::HeaderValue)>,
) -> Docker {
    let prefix = format!("/v{}", docker.client_version());
    docker.with_request_modifier(move |mut req| {
        let mut parts = req.uri().clone().into_parts();
        let path = parts.path_and_query.as_ref().map_or("/", |p| p.as_str());
        if !path.starts_with(&format!("{prefix}/")) {
            parts.path_and_query = format!("{prefix}{path}").parse().ok();
            if let Ok(uri) = http::Uri::from_parts(parts) {
                *req.uri_mut() = uri;
            }
        }
        if let Some((name, value)) = &header {
            req.headers_mut().insert(*name, value.clone());
        }
        req
    })
}

/// The address's scheme (`tcp` when none is written) and what follows it.
fn split_scheme(host: &str) -> (&str, &str) {
    host.split_once("://").unwrap_or(("tcp", host))
}

/// `HOST:PORT` of a TCP or TLS engine.
fn host_port(address: &EngineAddress) -> &str {
    address
        .host
        .as_deref()
        .map_or(LOCAL_SOCKET, |h| split_scheme(h).1)
}

fn client(address: &EngineAddress) -> Result<Docker, String> {
    let host = address.describe();
    let (scheme, rest) = split_scheme(&host);
    match (scheme, &address.tls) {
        ("unix", None) => {
            Docker::connect_with_unix(rest, REQUEST_TIMEOUT_S, API_DEFAULT_VERSION)
                .map_err(|e| format!("{}; start the engine or pass --docker-host", super::describe(&e)))
        }
        ("tcp" | "http", None) => {
            Docker::connect_with_http(rest, REQUEST_TIMEOUT_S, API_DEFAULT_VERSION)
                .map_err(|e| super::describe(&e))
        }
        ("tcp" | "https", Some(files)) => tls_client(rest, files),
        ("unix", Some(_)) => Err("TLS files were given for a local socket; drop them or pass --docker-host https://HOST:2376".into()),
        ("https", None) => Err(format!("{host} needs --docker-tls-cert, --docker-tls-key and --docker-tls-ca")),
        _ => Err(format!("{host} is not unix://PATH, tcp://HOST:PORT or https://HOST:PORT")),
    }
}

fn tls_client(host_port: &str, files: &TlsFiles) -> Result<Docker, String> {
    let config = tls_config(files)?;
    let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
    http.enforce_http(false);
    let https = hyper_rustls::HttpsConnector::from((http, Arc::new(config)));
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build(https);
    let transport = move |req: BollardRequest| {
        let client = client.clone();
        async move {
            client
                .request(req)
                .await
                .map_err(bollard::errors::Error::from)
        }
    };
    Docker::connect_with_custom_transport(
        transport,
        Some(format!("https://{host_port}")),
        REQUEST_TIMEOUT_S,
        API_DEFAULT_VERSION,
    )
    .map_err(|e| super::describe(&e))
}

fn tls_config(files: &TlsFiles) -> Result<rustls::ClientConfig, String> {
    let read = |path: &Path, flag: &str| {
        std::fs::read(path).map_err(|e| {
            format!(
                "cannot read {flag} {} ({e}); pass an existing PEM file",
                path.display()
            )
        })
    };
    let certs = |path: &Path, flag: &str| -> Result<Vec<_>, String> {
        let pem = read(path, flag)?;
        let certs: Vec<_> = rustls_pemfile::certs(&mut pem.as_slice())
            .collect::<Result<_, _>>()
            .map_err(|e| format!("{flag} {} is not PEM: {e}", path.display()))?;
        if certs.is_empty() {
            return Err(format!("{flag} {} holds no certificate", path.display()));
        }
        Ok(certs)
    };
    let mut roots = rustls::RootCertStore::empty();
    for ca in certs(&files.ca, "--docker-tls-ca")? {
        roots
            .add(ca)
            .map_err(|e| format!("--docker-tls-ca {}: {e}", files.ca.display()))?;
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| e.to_string())?
    .with_root_certificates(roots);
    let (cert, key) = match (&files.cert, &files.key) {
        (Some(cert), Some(key)) => (cert, key),
        (None, None) => return Ok(config.with_no_client_auth()),
        _ => {
            return Err(
                "--docker-tls-cert and --docker-tls-key go together; pass both or neither".into(),
            );
        }
    };
    let chain = certs(cert, "--docker-tls-cert")?;
    let key_pem = read(key, "--docker-tls-key")?;
    let key = rustls_pemfile::private_key(&mut key_pem.as_slice())
        .ok()
        .flatten()
        .ok_or_else(|| format!("--docker-tls-key {} holds no private key", key.display()))?;
    config.with_client_auth_cert(chain, key).map_err(|e| {
        format!("--docker-tls-cert and --docker-tls-key do not make a client identity: {e}")
    })
}

/// A failed first request over TLS, told apart: an untrusted server, a client certificate
/// missing or refused, each name the flags to fix. The request's own error may say only that
/// the connection ended (over TLS 1.3 the engine refuses a certificate after the handshake, and
/// the request can lose the race with its alert), so the handshake is tried once more on a
/// connection of its own that reads until the engine answers or ends it.
async fn tls_reason(e: &bollard::errors::Error, host_port: &str, files: &TlsFiles) -> String {
    let text = match tls_failure(host_port, files).await {
        Some(probe) => format!("{probe} {e:?}"),
        None => format!("{e:?}"),
    };
    if text.contains("UnknownIssuer")
        || text.contains("BadSignature")
        || text.contains("NotValidForName")
    {
        return "the engine's certificate is not trusted through --docker-tls-ca; pass the CA that signed it".into();
    }
    if files.cert.is_none()
        && (text.contains("CertificateRequired") || text.contains("HandshakeFailure"))
    {
        return "the engine requires a client certificate and none was given; pass --docker-tls-cert and --docker-tls-key signed by the CA the engine trusts".into();
    }
    if text.contains("CertificateRequired")
        || text.contains("BadCertificate")
        || text.contains("UnknownCA")
        || text.contains("unknown ca")
    {
        return "the engine refused this client's certificate; pass --docker-tls-cert and --docker-tls-key signed by the CA the engine trusts".into();
    }
    super::describe(e)
}

/// How a TLS connection to the engine ends when it sends a bare `/_ping` and reads to the end:
/// the handshake's error or the alert read after it, as text; `None` when it ends cleanly.
async fn tls_failure(host_port: &str, files: &TlsFiles) -> Option<String> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let config = Arc::new(tls_config(files).ok()?);
    let host = host_port.rsplit_once(':').map_or(host_port, |(h, _)| h);
    let name =
        rustls::pki_types::ServerName::try_from(host.trim_matches(['[', ']']).to_string()).ok()?;
    let probe = async {
        let tcp = tokio::net::TcpStream::connect(host_port).await?;
        let mut tls = tokio_rustls::TlsConnector::from(config)
            .connect(name, tcp)
            .await?;
        // The engine may have closed already; its alert is still there to read.
        let _ = tls.write_all(b"GET /_ping HTTP/1.0\r\n\r\n").await;
        let mut buf = [0u8; 4096];
        while tls.read(&mut buf).await? > 0 {}
        Ok::<_, std::io::Error>(())
    };
    match tokio::time::timeout(std::time::Duration::from_secs(10), probe).await {
        Ok(Err(e)) => Some(format!("{e:?}")),
        Ok(Ok(())) | Err(_) => None,
    }
}
