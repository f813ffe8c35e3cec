//! The agent's one way out: a TCP connection to the coordinator wrapped in TLS 1.3, presenting a
//! fresh short-lived certificate from the node key and accepting only the pinned server key.
use crate::identity::Identity;
use fleet_proto::pin;
use std::io;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The fleet's coordinators as this node knows them, and the one it talks to now; shared by the
/// session (which moves on when its coordinator does not answer) and the content path (which
/// follows the session).
#[derive(Clone, Debug)]
pub struct Coordinators(Arc<Mutex<Known>>);

#[derive(Debug)]
struct Known {
    addresses: Vec<String>,
    current: usize,
}

impl Coordinators {
    /// `addresses`, the first one current; the others in an order of this node's own, so the
    /// nodes of a coordinator that goes away spread over the rest instead of all moving to the
    /// same next one. Never empty.
    pub fn new(mut addresses: Vec<String>) -> Coordinators {
        assert!(
            !addresses.is_empty(),
            "a node knows at least one coordinator"
        );
        rand::seq::SliceRandom::shuffle(&mut addresses[1..], &mut rand::thread_rng());
        Coordinators(Arc::new(Mutex::new(Known {
            addresses,
            current: 0,
        })))
    }

    pub fn current(&self) -> String {
        let known = self.0.lock().expect("coordinators");
        known.addresses[known.current].clone()
    }

    /// Moves on to the next coordinator (the current one did not answer).
    pub fn advance(&self) {
        let mut known = self.0.lock().expect("coordinators");
        known.current = (known.current + 1) % known.addresses.len();
    }

    /// Every coordinator known, the current one first.
    pub fn all(&self) -> Vec<String> {
        let known = self.0.lock().expect("coordinators");
        let n = known.addresses.len();
        (0..n)
            .map(|i| known.addresses[(known.current + i) % n].clone())
            .collect()
    }

    /// Adds the coordinators a session named that were not known yet; true when any was new.
    pub fn learn(&self, named: &[String]) -> bool {
        let mut known = self.0.lock().expect("coordinators");
        let before = known.addresses.len();
        for address in named {
            if !known.addresses.contains(address) {
                known.addresses.push(address.clone());
            }
        }
        known.addresses.len() > before
    }
}

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

pub async fn dial(
    address: &str,
    identity: &Identity,
    pinned: &[u8],
    validity: Duration,
) -> Result<Dialed, DialError> {
    let credential = |e: &dyn std::fmt::Display| DialError::Credential(e.to_string());
    let cert = pin::mint_cert(&identity.key, validity).map_err(|e| credential(&e))?;
    let cert_not_after = pin::cert_info(&cert).map_err(|e| credential(&e))?.not_after;
    let seen = Arc::new(Mutex::new(None));
    let config = pin::client_config(&identity.key, cert, pinned.to_vec(), seen.clone())
        .map_err(|e| credential(&e))?;
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
    let result = tokio::time::timeout(CONNECT_TIMEOUT, handshake)
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
        Err(cause) => match seen.lock().expect("pin slot").take() {
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
