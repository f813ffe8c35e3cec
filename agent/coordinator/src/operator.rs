//! The operator socket: while `serve` holds the store's lock, the serving coordinator answers
//! operator commands on a unix socket in its data directory, one JSON line each way; without
//! one, the CLI opens the store itself. Both paths run [`commands::handle`].
use crate::Coordinator;
use crate::commands::{self, Request, Response};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

pub const SOCKET_FILE: &str = "operator.sock";

pub fn socket_path(data: &Path) -> PathBuf {
    data.join(SOCKET_FILE)
}

/// Binds the operator socket; done before the coordinator says it is listening, so operator
/// commands never race the socket.
pub fn bind(data: &Path) -> std::io::Result<tokio::net::UnixListener> {
    let path = socket_path(data);
    // We hold the store's lock, so a socket left here is from a coordinator that died.
    let _ = std::fs::remove_file(&path);
    let listener = tokio::net::UnixListener::bind(&path)?;
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    Ok(listener)
}

/// Serves operator requests, one JSON line each way, until the task is dropped.
pub async fn listen(
    listener: tokio::net::UnixListener,
    coordinator: Arc<Coordinator>,
    address: Option<String>,
) -> std::io::Result<()> {
    // Bound early so no command races the socket, but answered only once this coordinator has
    // recorded itself in the store: a run it takes must be findable by every other coordinator.
    while !coordinator.sessions().accepting() {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    loop {
        let (stream, _) = listener.accept().await?;
        let (coordinator, address) = (coordinator.clone(), address.clone());
        tokio::spawn(async move {
            let (read, mut write) = stream.into_split();
            let mut line = String::new();
            if BufReader::new(read).read_line(&mut line).await.is_err() {
                return;
            }
            let response = match serde_json::from_str::<Request>(&line) {
                Ok(request) => commands::handle(coordinator, address, request).await,
                Err(e) => Response::Error(format!("a malformed operator request: {e}")),
            };
            // Cannot fail: answers are plain data with string keys, which always serialize.
            let mut out = serde_json::to_vec(&response).expect("responses serialize");
            out.push(b'\n');
            let _ = write.write_all(&out).await;
        });
    }
}

/// Sends a request to a serving coordinator; None when none is serving from `data`.
/// Whether a coordinator serves `data` now (its operator socket answers a connection).
pub fn served(data: &Path) -> bool {
    std::os::unix::net::UnixStream::connect(socket_path(data)).is_ok()
}

pub fn call(data: &Path, request: &Request) -> Option<std::io::Result<Response>> {
    use std::io::{BufRead, Write};
    let stream = std::os::unix::net::UnixStream::connect(socket_path(data)).ok()?;
    let exchange = || {
        // Cannot fail: requests are plain data with string keys, which always serialize.
        let mut line = serde_json::to_vec(request).expect("requests serialize");
        line.push(b'\n');
        (&stream).write_all(&line)?;
        let mut answer = String::new();
        std::io::BufReader::new(&stream).read_line(&mut answer)?;
        serde_json::from_str(&answer).map_err(std::io::Error::other)
    };
    Some(exchange())
}
