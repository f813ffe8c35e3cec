//! Coordinators of one fleet, reaching each other. They share the fleet's key (each holds a copy
//! of `coordinator.key` in its data folder; no private key is ever in the database), so one
//! coordinator proves itself to another exactly as it proves itself to a node, over the same
//! pinned TLS, on the same port: a connection whose client certificate carries the fleet's own
//! key is a peer. A peer may ask for a command to be relayed to a node whose session this
//! coordinator holds ([`Up::Relay`]), and for a blob by digest ([`Up::Fetch`]).
use crate::Coordinator;
use crate::error::PeerError;
use fleet_content::{self as content, ContentError, Place};
use fleet_proto::dial::DialError;
use fleet_proto::protocol::{self, Answer, Command, Down, Opening, Refusal, RefusalClass, Up};
use fleet_proto::{Digest, NodeId};
use rcgen::KeyPair;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_rustls::client::TlsStream;

/// A peer's certificate lives for one copy or relay at most.
const PEER_CERT_VALIDITY: Duration = Duration::from_secs(3600);

/// Where a `run` pushes what it imports: the first `wanted` of `peers` that take the connection,
/// in the order the serving coordinator asks them to hold it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct CopyTargets {
    pub peers: Vec<String>,
    pub wanted: usize,
}

/// A pinned TLS connection to the coordinator at `address`, proving the fleet's `key`.
async fn dial(key: &KeyPair, address: &str) -> Result<TlsStream<TcpStream>, PeerError> {
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
    let mut stream = dial(coordinator.key(), address).await?;
    let ask = Up::Relay {
        node_id: node_id.clone(),
        command,
    };
    protocol::write_msg(&mut stream, &Opening::new(ask)).await?;
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
        let dialed = dial(coordinator.key(), address).await;
        let mut stream = dialed.map_err(|e| failed(e.to_string()))?;
        let fetch = Up::Copy {
            digest: *digest,
            offset,
        };
        protocol::write_msg(&mut stream, &Opening::new(fetch))
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

/// Has the coordinator at `address` keep a copy of the blob `digest` (it copies it from
/// whichever coordinator holds it); returns once it holds it, checked.
pub(crate) async fn ask_to_hold(
    coordinator: &Coordinator,
    address: &str,
    digest: &Digest,
) -> Result<(), PeerError> {
    let failed = |reason: String| {
        PeerError::Content(ContentError::Failed {
            content: digest.to_string(),
            reason,
        })
    };
    let mut stream = dial(coordinator.key(), address).await?;
    protocol::write_msg(&mut stream, &Opening::new(Up::Hold { digest: *digest })).await?;
    match protocol::read_msg::<_, Down>(&mut stream).await? {
        Some(Down::Stored { digest: held }) if held == *digest => Ok(()),
        Some(Down::ContentRefused { message }) => Err(failed(format!("{address}: {message}"))),
        other => Err(failed(format!("{address} answered a hold with {other:?}"))),
    }
}

/// What an import hands each push: the bytes as they are read, then the digest they hash to.
#[derive(Clone)]
pub(crate) enum Piece {
    Bytes(Arc<Vec<u8>>),
    Hashed(Digest),
}

/// How long a push may take nothing (a piece, or its answer after the last one) before the
/// import goes on without it: a coordinator that hangs never holds `run` up.
const PUSH_STALL: Duration = Duration::from_secs(30);

/// A push's connection, opened before the import reads a byte.
pub(crate) struct PushLink {
    address: String,
    stream: TlsStream<TcpStream>,
}

/// Opens a push of `size` bytes to the coordinator at `address` ([`Up::Push`]).
pub(crate) async fn open_push(
    key: &KeyPair,
    address: &str,
    size: u64,
) -> Result<PushLink, PeerError> {
    let mut stream = dial(key, address).await?;
    protocol::write_msg(&mut stream, &Opening::new(Up::Push { size })).await?;
    Ok(PushLink {
        address: address.to_string(),
        stream,
    })
}

impl PushLink {
    pub(crate) fn address(&self) -> &str {
        &self.address
    }

    /// Sends the bytes as `pieces` brings them, then the digest they hash to; returns once the
    /// other coordinator holds them as a blob, checked.
    pub(crate) async fn push(
        mut self,
        mut pieces: mpsc::Receiver<Piece>,
    ) -> Result<Digest, PeerError> {
        let address = self.address.clone();
        let failed = |reason: String| {
            PeerError::Content(ContentError::Failed {
                content: format!("a copy pushed to {address}"),
                reason,
            })
        };
        let stream = &mut self.stream;
        let stalled = || failed(format!("it took nothing for {} s", PUSH_STALL.as_secs()));
        let digest = loop {
            match pieces.recv().await {
                Some(Piece::Bytes(bytes)) => {
                    (tokio::time::timeout(PUSH_STALL, stream.write_all(&bytes)).await)
                        .map_err(|_| stalled())?
                        .map_err(|e| failed(format!("sending failed: {e}")))?
                }
                Some(Piece::Hashed(digest)) => break digest,
                None => return Err(failed("the import stopped".into())),
            }
        };
        protocol::write_msg(stream, &Up::Sent { digest }).await?;
        let answer = tokio::time::timeout(PUSH_STALL, protocol::read_msg::<_, Down>(stream));
        match answer.await.map_err(|_| stalled())?? {
            Some(Down::Stored { digest: held }) if held == digest => Ok(digest),
            Some(Down::ContentRefused { message }) => Err(failed(message)),
            other => Err(failed(format!("answered with {other:?}"))),
        }
    }
}

impl Coordinator {
    /// Has enough other coordinators of the fleet keep a copy of each of `digests` that the
    /// fleet's `content_copies` hold it (or every coordinator, when fewer serve: one that does
    /// not take the connection serves no more), so losing any one coordinator loses no content.
    /// Err names each copy that failed.
    pub(crate) async fn spread(&self, digests: &[Digest]) -> Result<(), crate::CoordinatorError> {
        if self.fleet().content_copies() < 2 {
            return Ok(());
        }
        self.learn_fleet_now().await;
        for digest in digests {
            self.hold_copies(digest).await.map_err(|short| {
                crate::CoordinatorError::Request(format!(
                    "{short}; nothing was recorded: run it again once the fleet's coordinators answer"
                ))
            })?;
        }
        Ok(())
    }

    /// The coordinators [`Coordinator::hold_copies`] asks, in its order, and how many of them
    /// it wants holding: an operator command pushes its content to the first that answer while
    /// it imports it. None unless the fleet keeps more than one copy.
    pub(crate) async fn copy_targets(&self) -> CopyTargets {
        let wanted = self.fleet().content_copies().saturating_sub(1);
        if wanted == 0 {
            return CopyTargets::default();
        }
        self.learn_fleet_now().await;
        CopyTargets {
            peers: self.fleet().peers(),
            wanted,
        }
    }

    /// Asks the members last heard, in turn, to hold `digest` until `content_copies` do (this
    /// one included); Err says how many hold it and what the others answered.
    pub(crate) async fn hold_copies(&self, digest: &Digest) -> Result<(), PeerError> {
        let wanted = self.fleet().content_copies().saturating_sub(1);
        let peers = self.fleet().peers();
        let (mut held, mut away, mut failures) = (0, 0, Vec::new());
        for address in &peers {
            if held == wanted {
                break;
            }
            match ask_to_hold(self, address, digest).await {
                Ok(()) => held += 1,
                // Not listening any more: it serves no longer, whatever its last record says.
                Err(PeerError::Dial(DialError::Unreachable { .. })) => away += 1,
                Err(e) => failures.push(e.to_string()),
            }
        }
        if held < wanted.min(peers.len() - away) {
            return Err(PeerError::FewCopies {
                digest: *digest,
                held: held + 1,
                wanted: wanted + 1,
                answers: failures.join("; "),
            });
        }
        Ok(())
    }

    /// A peer's relayed command, passed to the node whose session this coordinator holds. A
    /// collect's upload is let in here under the name the peer gave it, and kept as a blob by
    /// its digest, for the peer to copy.
    pub(crate) async fn relayed(&self, node_id: &NodeId, command: Command) -> Answer {
        let _expected = match &command {
            Command::Collect { upload, .. } => {
                Some(self.uploads().expect(upload, node_id, Place::Blob))
            }
            _ => None,
        };
        match self.call_held(node_id, command).await {
            Ok(answer) => answer,
            Err(e) => Err(Refusal::new(RefusalClass::NoSession, e.to_string())),
        }
    }

    /// Reads which coordinators serve the store now (those heard within `lease`) into the fleet
    /// view; the sessions held here are told when the set changed.
    pub(crate) fn learn_fleet(&self, lease: Duration) -> Result<(), crate::CoordinatorError> {
        self.fleet().heard(members_now(self.store(), lease)?);
        Ok(())
    }

    /// [`Coordinator::learn_fleet`] off the async thread, while serving; a failure is logged and
    /// the view stays as it was.
    async fn learn_fleet_now(&self) {
        let Some(lease) = self.fleet().heard_within() else {
            return;
        };
        match self
            .with_store(move |store| members_now(store, lease))
            .await
        {
            Ok(members) => self.fleet().heard(members),
            Err(e) => tracing::warn!("reading the fleet's coordinators failed: {e}"),
        }
    }

    /// The members as the store says now, for a welcome: read once this call began, by it or by
    /// a read begun after it began (sessions opening at once share one read).
    pub(crate) async fn learn_fleet_fresh(&self) {
        let asked = self.fleet().reads_begun();
        let turn = self.fleet().read_turn_after(asked).await;
        if let Some(_turn) = turn {
            self.learn_fleet_now().await;
        }
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
        let (mut failures, mut tried) = (Vec::new(), Vec::new());
        // The members as last heard, then as the store says now: a coordinator that started
        // since this one's last sweep (the one the content was imported through) is asked too.
        for fresh in [false, true] {
            if fresh {
                self.learn_fleet_now().await;
            }
            for address in self.fleet().peers() {
                if tried.contains(&address) {
                    continue;
                }
                tried.push(address.clone());
                match pull(self, &address, digest).await {
                    Ok(()) => {
                        tracing::info!(%digest, from = %address, "content copied from another coordinator");
                        return Ok(());
                    }
                    Err(e) => failures.push(e),
                }
            }
        }
        Err(match failures.is_empty() {
            true => PeerError::Nowhere(*digest),
            false => PeerError::Each(failures),
        })
    }
}

/// The coordinators the store says were heard within `lease`.
fn members_now(
    store: &crate::store::Store,
    lease: Duration,
) -> crate::store::StoreResult<Vec<String>> {
    let since = fleet_proto::clock::now_ms().saturating_sub(lease.as_millis() as u64);
    store.coordinators_since(since)
}
