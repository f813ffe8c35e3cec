//! The pinned dial both sides use: a TCP connection wrapped in TLS 1.3, presenting a fresh
//! short-lived certificate from the caller's key and accepting only the pinned server key. A
//! node dials its coordinator with it; a coordinator dials another of its fleet (both prove and
//! pin the fleet's key).
use crate::pin;
use rcgen::KeyPair;
use std::io;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the TLS handshake may take once connected: a coordinator busy with a restart's
/// returning nodes queues each for its turn (up to half of this) instead of dropping it, and a
/// dropped node's retry costs it a backoff and the coordinator a connection (BENCHMARKS.md).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum DialError {
    #[error(
        "the coordinator at {address} presented key {seen}, but this node pins {pinned}: refusing to talk to it (check the join file's coordinator_key)"
    )]
    PinMismatch {
        address: String,
        seen: String,
        pinned: String,
    },
    #[error("cannot reach the coordinator at {address}: {cause}")]
    Unreachable { address: String, cause: io::Error },
    #[error("the TLS handshake with {address} failed: {cause}")]
    Handshake { address: String, cause: io::Error },
    #[error("cannot make a session certificate: {0}")]
    Credential(String),
}

impl DialError {
    /// A wrong server key will not fix itself by retrying.
    pub fn is_fatal(&self) -> bool {
        matches!(
            self,
            DialError::PinMismatch { .. } | DialError::Credential(_)
        )
    }
}

/// A connected, authenticated stream and the moment (Unix seconds) our certificate lapses.
pub struct Dialed {
    pub stream: TlsStream<TcpStream>,
    pub cert_not_after: i64,
}

/// Dials `address` as the holder of `key` (with a certificate valid for `validity`), accepting
/// only a server proving `pinned`.
pub async fn dial(
    address: &str,
    key: &KeyPair,
    pinned: &[u8],
    validity: Duration,
) -> Result<Dialed, DialError> {
    let credential = |e: &dyn std::fmt::Display| DialError::Credential(e.to_string());
    let cert = pin::mint_cert(key, validity).map_err(|e| credential(&e))?;
    let cert_not_after = pin::cert_info(&cert).map_err(|e| credential(&e))?.not_after;
    let seen = Arc::new(Mutex::new(None));
    let config =
        pin::client_config(key, cert, pinned.to_vec(), seen.clone()).map_err(|e| credential(&e))?;
    let unreachable = |cause| DialError::Unreachable {
        address: address.to_string(),
        cause,
    };
    let tcp = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(address))
        .await
        .map_err(|_| unreachable(io::Error::new(io::ErrorKind::TimedOut, "connect timed out")))?
        .map_err(unreachable)?;
    let _ = tcp.set_nodelay(true);
    let handshake = tokio_rustls::TlsConnector::from(config).connect(pin::server_name(), tcp);
    let result = tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake)
        .await
        .unwrap_or_else(|_| {
            Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "handshake timed out",
            ))
        });
    match result {
        Ok(stream) => Ok(Dialed {
            stream,
            cert_not_after,
        }),
        Err(cause) => match seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
        {
            Some(seen) => Err(DialError::PinMismatch {
                address: address.to_string(),
                seen: pin::key_text(&seen),
                pinned: pin::key_text(pinned),
            }),
            None => Err(DialError::Handshake {
                address: address.to_string(),
                cause,
            }),
        },
    }
}
