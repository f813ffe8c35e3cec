//! The plain-HTTP side of the coordinator's port: `GET /bundles/hub-linux-<arch>.tar.gz` (and
//! `.sha256`), answered only while some machine is waiting to join; 404 otherwise.
use super::{Coordinator, bundle_path, file_sha256};
use fleet_proto::fsutil::now_ms;
use std::path::Path;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const MAX_HEAD: usize = 8 << 10;
const ARCHES: [&str; 2] = ["x86_64", "arm64"];

pub async fn handle(coordinator: &Coordinator, bundles: &Path, mut stream: TcpStream) {
    let Some(path) = read_request_path(&mut stream).await else {
        return;
    };
    let waiting = coordinator
        .with_store(|store| store.has_waiting_token(now_ms()))
        .await
        .unwrap_or(false);
    let answer = match route(&path) {
        Some((arch, want_sum)) if waiting => {
            let bundle = bundle_path(bundles, arch);
            if want_sum {
                let name = format!("hub-linux-{arch}.tar.gz");
                match tokio::task::spawn_blocking(move || file_sha256(&bundle)).await {
                    Ok(Ok(sum)) => {
                        respond(&mut stream, "200 OK", format!("{sum}  {name}\n").as_bytes()).await
                    }
                    _ => not_found(&mut stream).await,
                }
            } else {
                send_file(&mut stream, &bundle).await
            }
        }
        _ => not_found(&mut stream).await,
    };
    if let Err(e) = answer {
        tracing::debug!(error = %e, "an HTTP client went away");
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

async fn read_request_path(stream: &mut TcpStream) -> Option<String> {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    let read = async {
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < MAX_HEAD {
            let n = stream.read(&mut buf).await.ok()?;
            if n == 0 {
                return None;
            }
            head.extend_from_slice(&buf[..n]);
        }
        Some(())
    };
    tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .ok()??;
    let line = String::from_utf8_lossy(&head).lines().next()?.to_string();
    let mut parts = line.split_whitespace();
    match (parts.next(), parts.next()) {
        (Some("GET"), Some(path)) => Some(path.to_string()),
        _ => Some(String::new()),
    }
}

async fn respond(stream: &mut TcpStream, status: &str, body: &[u8]) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\ncontent-length: {}\r\ncontent-type: text/plain\r\nconnection: close\r\n\r\n",
        body.len()
    );
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
    use super::route;

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
