//! The plain-HTTP side of the coordinator's port: `GET /bundles/hub-linux-<arch>.tar.gz` (and
//! `.sha256`), answered only while some machine is waiting to join; 404 otherwise. And
//! `POST /bootstrap/failed/<sha256 of the token>` with the reason as its body: a machine whose
//! bootstrap failed says why (it names its token only by the hash), recorded on that token so
//! `nodes` shows it.
use super::{Coordinator, bundle_path, file_sha256};
use fleet_proto::clock::now_ms;
use std::path::Path;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const MAX_HEAD: usize = 8 << 10;
/// The longest failure reason kept; a longer one is cut.
pub const MAX_REASON: usize = 1024;
const ARCHES: [&str; 2] = ["x86_64", "arm64"];
/// Where a machine reports its failed bootstrap, followed by its token's SHA-256 (hex).
pub const FAILURE_PATH: &str = "/bootstrap/failed/";

pub async fn handle(coordinator: &Coordinator, bundles: &Path, mut stream: TcpStream) {
    let Some(request) = read_request(&mut stream).await else {
        return;
    };
    let answer = match request.method.as_str() {
        "POST" => report_failure(coordinator, &request, &mut stream).await,
        "GET" => get(coordinator, bundles, &request.path, &mut stream).await,
        _ => not_found(&mut stream).await,
    };
    if let Err(e) = answer {
        tracing::debug!(error = %e, "an HTTP client went away");
    }
}

/// Records a machine's failed bootstrap on its token: 200 when recorded, 404 when no waiting
/// token has that hash (unknown, spent, expired, or already reported).
async fn report_failure(
    coordinator: &Coordinator,
    request: &Request,
    stream: &mut TcpStream,
) -> std::io::Result<()> {
    let Some(hash) = request
        .path
        .strip_prefix(FAILURE_PATH)
        .filter(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
        .map(str::to_ascii_lowercase)
    else {
        return not_found(stream).await;
    };
    let reason = one_line(&request.body);
    let (h, r) = (hash.clone(), reason.clone());
    let recorded = coordinator
        .with_store(move |store| store.fail_bootstrap(&h, &r, now_ms()))
        .await;
    match recorded {
        Ok(true) => {
            tracing::warn!(token_sha256 = %hash, %reason, "a machine's bootstrap failed");
            respond(stream, "200 OK", b"recorded\n").await
        }
        Ok(false) => not_found(stream).await,
        Err(e) => {
            tracing::error!(error = %e, "cannot record a failed bootstrap");
            respond(stream, "500 Internal Server Error", b"not recorded\n").await
        }
    }
}

/// The reason as one printable line of at most [`MAX_REASON`] bytes.
fn one_line(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let mut line: String = text
        .trim()
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if line.len() > MAX_REASON {
        let mut cut = MAX_REASON;
        while !line.is_char_boundary(cut) {
            cut -= 1;
        }
        line.truncate(cut);
    }
    line
}

async fn get(
    coordinator: &Coordinator,
    bundles: &Path,
    path: &str,
    stream: &mut TcpStream,
) -> std::io::Result<()> {
    let waiting = coordinator
        .with_store(|store| store.has_waiting_token(now_ms()))
        .await
        .unwrap_or(false);
    match route(path) {
        Some((arch, want_sum)) if waiting => {
            let bundle = bundle_path(bundles, arch);
            if want_sum {
                let name = format!("hub-linux-{arch}.tar.gz");
                match tokio::task::spawn_blocking(move || file_sha256(&bundle)).await {
                    Ok(Ok(sum)) => {
                        respond(stream, "200 OK", format!("{sum}  {name}\n").as_bytes()).await
                    }
                    _ => not_found(stream).await,
                }
            } else {
                send_file(stream, &bundle).await
            }
        }
        _ => not_found(stream).await,
    }
}

/// `Some((arch, is_checksum))` for the two bundle paths.
fn route(path: &str) -> Option<(&'static str, bool)> {
    let rest = path.strip_prefix("/bundles/hub-linux-")?;
    let (arch, want_sum) = match rest.strip_suffix(".tar.gz.sha256") {
        Some(arch) => (arch, true),
        None => (rest.strip_suffix(".tar.gz")?, false),
    };
    ARCHES
        .into_iter()
        .find(|a| *a == arch)
        .map(|a| (a, want_sum))
}

/// One HTTP/1.1 request as read: its line, headers and a bounded body.
pub(crate) struct Request {
    pub(crate) method: String,
    /// The target as sent, query included.
    pub(crate) path: String,
    headers: Vec<(String, String)>,
    /// At most [`MAX_REASON`] bytes of the body.
    pub(crate) body: Vec<u8>,
}

impl Request {
    /// The first header of that name (case-insensitive), trimmed.
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        (self.headers.iter())
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Reads the head, and for a POST its body (by `content-length`, at most [`MAX_REASON`] bytes).
/// None for anything that is not a request within 10 s.
pub(crate) async fn read_request(stream: &mut TcpStream) -> Option<Request> {
    let mut data = Vec::new();
    let mut buf = [0u8; 1024];
    let read = async {
        let end = loop {
            if let Some(at) = data.windows(4).position(|w| w == b"\r\n\r\n") {
                break at + 4;
            }
            if data.len() >= MAX_HEAD {
                return None;
            }
            let n = stream.read(&mut buf).await.ok()?;
            if n == 0 {
                return None;
            }
            data.extend_from_slice(&buf[..n]);
        };
        let head = String::from_utf8_lossy(&data[..end]).into_owned();
        let mut lines = head.lines();
        let mut parts = lines.next()?.split_whitespace();
        let (method, path) = (parts.next()?.to_string(), parts.next()?.to_string());
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
            .collect();
        let length = (headers.iter())
            .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
            .and_then(|(_, v)| v.parse::<usize>().ok())
            .unwrap_or(0)
            .min(MAX_REASON);
        let mut body = data[end..].to_vec();
        while body.len() < length {
            let n = stream.read(&mut buf).await.ok()?;
            if n == 0 {
                break;
            }
            body.extend_from_slice(&buf[..n]);
        }
        body.truncate(length);
        Some(Request {
            method,
            path,
            headers,
            body,
        })
    };
    tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .ok()?
}

async fn respond(stream: &mut TcpStream, status: &str, body: &[u8]) -> std::io::Result<()> {
    respond_with(stream, status, &[("content-type", "text/plain")], body).await
}

/// Answers with `status`, the headers given, and `body`, then closes.
pub(crate) async fn respond_with(
    stream: &mut TcpStream,
    status: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> std::io::Result<()> {
    let mut head = format!("HTTP/1.1 {status}\r\ncontent-length: {}\r\n", body.len());
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("connection: close\r\n\r\n");
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body).await?;
    stream.shutdown().await
}

async fn not_found(stream: &mut TcpStream) -> std::io::Result<()> {
    respond(stream, "404 Not Found", b"not found\n").await
}

async fn send_file(stream: &mut TcpStream, path: &Path) -> std::io::Result<()> {
    let Ok(mut file) = tokio::fs::File::open(path).await else {
        return not_found(stream).await;
    };
    let len = file.metadata().await?.len();
    let head = format!(
        "HTTP/1.1 200 OK\r\ncontent-length: {len}\r\ncontent-type: application/gzip\r\nconnection: close\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).await?;
    tokio::io::copy(&mut file, stream).await?;
    stream.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::{MAX_REASON, one_line, route};

    #[test]
    fn a_reason_is_one_bounded_line() {
        assert_eq!(one_line(b" bad\nbundle\r\n"), "bad bundle");
        assert_eq!(one_line(&[b'x'; 5000]).len(), MAX_REASON);
    }

    #[test]
    fn routes_only_known_bundles() {
        assert_eq!(
            route("/bundles/hub-linux-x86_64.tar.gz"),
            Some(("x86_64", false))
        );
        assert_eq!(
            route("/bundles/hub-linux-arm64.tar.gz.sha256"),
            Some(("arm64", true))
        );
        assert_eq!(route("/bundles/hub-linux-../x.tar.gz"), None);
        assert_eq!(route("/other"), None);
    }
}
