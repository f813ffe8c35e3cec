//! Coordinators of one fleet, reaching each other. They share the fleet's key (each holds a copy
//! of `coordinator.key` in its data folder; no private key is ever in the database), so one
//! coordinator proves itself to another exactly as it proves itself to a node, over the same
//! pinned TLS, on the same port: a connection whose client certificate carries the fleet's own
//! key is a peer. A peer may ask for a command to be relayed to a node whose session this
//! coordinator holds ([`Up::Relay`]), and for a blob by digest ([`Up::Fetch`]).
use crate::runs::off_thread;
use crate::{Coordinator, KEY_FILE};
use fleet_content::{self as content, ContentError};
use fleet_proto::dial::DialError;
use fleet_proto::protocol::{
    self, Answer, Command, Down, FrameError, Refusal, RefusalClass, Reply, Up,
};
use fleet_proto::{Digest, NodeId};
use std::time::Duration;
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

/// A peer's certificate lives for one copy or relay at most.
const PEER_CERT_VALIDITY: Duration = Duration::from_secs(3600);

/// Why another coordinator of the fleet could not do what was asked of it.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    #[error(
        "the coordinator at {address} presented key {seen}, not this fleet's key {pinned}: its data folder holds another {}; copy this fleet's key there and restart it",
        KEY_FILE
    )]
    ForeignKey {
        address: String,
        seen: String,
        pinned: String,
    },
    #[error(transparent)]
    Dial(DialError),
    #[error(transparent)]
    Frame(#[from] FrameError),
    #[error("the coordinator {address} did not answer for {node_id} in time")]
    Late { address: String, node_id: NodeId },
    #[error("the coordinator {address} answered a relay for {node_id} with {answer}")]
    Unexpected {
        address: String,
        node_id: NodeId,
        answer: String,
    },
    #[error(transparent)]
    Content(#[from] ContentError),
    #[error("no coordinator of the fleet holds {0}")]
    Nowhere(Digest),
    /// Every coordinator of the fleet was asked; each failure, in order.
    #[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Each(Vec<PeerError>),
}

/// A pinned TLS connection to the coordinator at `address`, proving the fleet's key.
async fn dial(coordinator: &Coordinator, address: &str) -> Result<TlsStream<TcpStream>, PeerError> {
    let key = coordinator.key();
    let dialed = fleet_proto::dial::dial(address, key, key.public_key_raw(), PEER_CERT_VALIDITY);
    match dialed.await {
        Ok(dialed) => Ok(dialed.stream),
        Err(DialError::PinMismatch { seen, pinned, .. }) => Err(PeerError::ForeignKey {
            address: address.to_string(),
            seen,
            pinned,
        }),
        Err(e) => Err(PeerError::Dial(e)),
    }
}

/// Has the coordinator at `address` pass `command` to the node whose session it holds, and
/// returns the node's answer.
pub(crate) async fn relay(
    coordinator: &Coordinator,
    address: &str,
    node_id: &NodeId,
    command: Command,
    patience: Duration,
) -> Result<Answer, PeerError> {
    let mut stream = dial(coordinator, address).await?;
    let ask = Up::Relay {
        node_id: node_id.clone(),
        command,
    };
    protocol::write_msg(&mut stream, &ask).await?;
    let answered = tokio::time::timeout(patience, protocol::read_msg::<_, Down>(&mut stream))
        .await
        .map_err(|_| PeerError::Late {
            address: address.to_string(),
            node_id: node_id.clone(),
        })?;
    match answered? {
        Some(Down::Relayed { answer }) => {
            coordinator.recorder().relayed();
            Ok(answer)
        }
        other => Err(PeerError::Unexpected {
            address: address.to_string(),
            node_id: node_id.clone(),
            answer: format!("{other:?}"),
        }),
    }
}

/// Copies the blob `digest` from the coordinator at `address` into this coordinator's blob
/// store, through the one landing every content transfer uses: hashed as it arrives, checked
/// before it lands, and resumed from what a cut copy left.
pub(crate) async fn pull(
    coordinator: &Coordinator,
    address: &str,
    digest: &Digest,
) -> Result<(), PeerError> {
    let landed = content::land(coordinator.blobs(), digest, |offset| async move {
        let failed = |reason: String| ContentError::Failed {
            content: digest.to_string(),
            reason,
        };
        let dialed = dial(coordinator, address).await;
        let mut stream = dialed.map_err(|e| failed(e.to_string()))?;
        let fetch = Up::Copy {
            digest: *digest,
            offset,
        };
        protocol::write_msg(&mut stream, &fetch)
            .await
            .map_err(|e| failed(format!("asking {address} for it failed: {e}")))?;
        match protocol::read_msg::<_, Down>(&mut stream).await {
            Ok(Some(Down::Content { size })) => Ok((stream, size, offset)),
            Ok(Some(Down::ContentRefused { message })) => Err(failed(message)),
            other => Err(failed(format!("{address} answered a fetch with {other:?}"))),
        }
    });
    landed.await?;
    coordinator.recorder().copied_from_peer();
    Ok(())
}

impl Coordinator {
    /// A peer's relayed command, passed to the node whose session this coordinator holds. A
    /// collect's upload is let in here under the name the peer gave it, and kept as a blob by
    /// its digest, for the peer to copy.
    pub(crate) async fn relayed(&self, node_id: &NodeId, command: Command) -> Answer {
        let expected = match &command {
            Command::Collect { upload, .. } => Some(self.uploads().expect(upload, node_id)),
            _ => None,
        };
        let answer = match self.call_held(node_id, command).await {
            Ok(answer) => answer,
            Err(e) => Err(Refusal::new(RefusalClass::NoSession, e.to_string())),
        };
        if let Some(expected) = expected {
            let upload = expected.name().clone();
            drop(expected);
            if let Ok(Reply::Collected { digest, .. }) = &answer {
                let (blobs, digest) = (self.blobs().clone(), *digest);
                let kept =
                    off_thread(move || blobs.commit(&blobs.collected(&upload), &digest)).await;
                if let Err(e) = kept {
                    tracing::warn!(%node_id, "cannot keep a relayed collect as a blob: {e}");
                }
            }
        }
        answer
    }

    /// Makes sure the blob store holds `digest`, copying it from another coordinator of the
    /// fleet when it does not (content imported through one coordinator, asked for through
    /// another). Err says why it is still missing.
    pub(crate) async fn ensure_blob(&self, digest: &Digest) -> Result<(), PeerError> {
        if self.blobs().has(digest) {
            return Ok(());
        }
        let _one_copy = self.pulls().one_at_a_time(digest).await;
        // Another copy may have landed it while this one waited.
        if self.blobs().has(digest) {
            return Ok(());
        }
        let mut failures = Vec::new();
        for address in self.fleet().peers() {
            match pull(self, &address, digest).await {
                Ok(()) => {
                    tracing::info!(%digest, from = %address, "content copied from another coordinator");
                    return Ok(());
                }
                Err(e) => failures.push(e),
            }
        }
        Err(match failures.is_empty() {
            true => PeerError::Nowhere(*digest),
            false => PeerError::Each(failures),
        })
    }
}
