//! An artifact read through an external HTTP(S) URL (an object store's presigned URL, say): one
//! GET asking for the bytes from the offset already held, its body streamed into
//! [`fleet_content::land`]. HTTPS trusts the system's roots (or `SSL_CERT_FILE`), through rustls
//! on ring. The URL is the whole credential and is never logged.
use fleet_content::ContentError;
use fleet_proto::Digest;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// A connection to the URL's server, plain or TLS.
pub trait Connection: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Connection for T {}

/// The body of an answer, after its head.
pub type Body = BufReader<Box<dyn Connection>>;

const CONNECT: Duration = Duration::from_secs(10);
/// The answer's status line and headers, at most.
const MAX_HEAD: usize = 16 << 10;

/// Asks `url` for the content from `offset`; gives the body, the whole size and the offset the
/// body starts at (0 when the server answers the whole content). Refused once `deadline` passed.
pub async fn open(
    url: &str,
    digest: &Digest,
    offset: u64,
    deadline: Instant,
) -> Result<(Body, u64, u64), ContentError> {
    let failed = |reason: String| ContentError::Failed {
        content: digest.to_string(),
        reason,
    };
    let cut = |cause: String| ContentError::Cut {
        content: digest.to_string(),
        got: offset,
        size: 0,
        cause,
    };
    if Instant::now() >= deadline {
        return Err(failed(
            "its URL read expired before the copy began; mint a new one".into(),
        ));
    }
    let (tls, rest) = if let Some(rest) = url.strip_prefix("http://") {
        (false, rest)
    } else if let Some(rest) = url.strip_prefix("https://") {
        (true, rest)
    } else {
        return Err(failed("its URL is not http(s)://HOST[:PORT]/PATH".into()));
    };
    let (host, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let (name, address) = match host.rsplit_once(':') {
        Some((name, port))
            if port.parse::<u16>().is_ok() && (name.starts_with('[') || !name.contains(':')) =>
        {
            (name.trim_matches(['[', ']']).to_string(), host.to_string())
        }
        _ => (
            host.to_string(),
            format!("{host}:{}", if tls { 443 } else { 80 }),
        ),
    };
    let tcp = tokio::time::timeout(CONNECT, TcpStream::connect(&address))
        .await
        .map_err(|_| cut(format!("connecting to {host} timed out")))?
        .map_err(|e| cut(format!("cannot reach {host}: {e}")))?;
    let mut stream: Box<dyn Connection> = match tls {
        false => Box::new(tcp),
        true => {
            let server = rustls::pki_types::ServerName::try_from(name.clone())
                .map_err(|_| failed(format!("{name} is not a host name TLS can check")))?;
            let handshake = tokio_rustls::TlsConnector::from(tls_config().map_err(failed)?)
                .connect(server, tcp);
            let stream = tokio::time::timeout(CONNECT, handshake)
                .await
                .map_err(|_| cut(format!("the TLS handshake with {host} timed out")))?
                .map_err(|e| failed(format!("the TLS handshake with {host} failed ({e}); is its certificate signed by a root this machine trusts?")))?;
            Box::new(stream)
        }
    };
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nRange: bytes={offset}-\r\nConnection: close\r\n\r\n"
    );
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(|e| cut(e.to_string()))?;
    let mut reader: Body = BufReader::new(stream);
    let mut head = Vec::new();
    let mut line = String::new();
    loop {
        line.clear();
        let n = reader
            .read_line(&mut line)
            .await
            .map_err(|e| cut(e.to_string()))?;
        if n == 0 {
            return Err(cut(
                "the server closed the connection before answering".into()
            ));
        }
        if line == "\r\n" || line == "\n" {
            break;
        }
        head.push(line.trim_end().to_string());
        if head.iter().map(String::len).sum::<usize>() > MAX_HEAD {
            return Err(failed(format!(
                "{host} answered with over {MAX_HEAD} bytes of headers"
            )));
        }
    }
    let status: u16 = head
        .first()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| failed(format!("{host} did not answer HTTP")))?;
    let header = |name: &str| {
        head.iter().skip(1).find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_string())
        })
    };
    let length = || {
        header("content-length")
            .and_then(|v| v.parse::<u64>().ok())
            .ok_or_else(|| failed(format!("{host} sent no Content-Length")))
    };
    match status {
        200 => Ok((reader, length()?, 0)),
        206 => {
            // Content-Range: bytes FROM-TO/SIZE
            let range = header("content-range").unwrap_or_default();
            let parsed = range.strip_prefix("bytes ").and_then(|r| {
                let (span, size) = r.split_once('/')?;
                let (from, _) = span.split_once('-')?;
                Some((from.parse::<u64>().ok()?, size.parse::<u64>().ok()?))
            });
            let (from, size) = parsed.ok_or_else(|| {
                failed(format!(
                    "{host} sent a partial answer without a usable Content-Range"
                ))
            })?;
            Ok((reader, size, from))
        }
        code => Err(failed(format!(
            "the URL answered HTTP {code}; the read may be expired or wrong, mint a new one"
        ))),
    }
}

/// The system's roots (or `SSL_CERT_FILE`'s), made once.
fn tls_config() -> Result<Arc<rustls::ClientConfig>, String> {
    static CONFIG: std::sync::OnceLock<Result<Arc<rustls::ClientConfig>, String>> =
        std::sync::OnceLock::new();
    CONFIG
        .get_or_init(|| {
            let mut roots = rustls::RootCertStore::empty();
            let found = rustls_native_certs::load_native_certs();
            for cert in found.certs {
                let _ = roots.add(cert);
            }
            if roots.is_empty() {
                return Err("this machine has no trusted root certificates (set SSL_CERT_FILE or install ca-certificates)".into());
            }
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let config = rustls::ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .map_err(|e| e.to_string())?
                .with_root_certificates(roots)
                .with_no_client_auth();
            Ok(Arc::new(config))
        })
        .clone()
}
