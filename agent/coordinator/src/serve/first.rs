//! A TLS connection's first message, which says what the connection is for: a join, a node's
//! session, a node's content fetch or upload, or (from a peer proving the fleet's key) a relay
//! or a blob copy. Each is handled by a function of its own.
use super::ServeConfig;
use super::identify::{ended, known_node};
use super::link::{self, Stopping};
use crate::content::{Asker, refuse};
use crate::error::Dropped;
use crate::live::Admission;
use crate::{Coordinator, node_id, token_hash};
use fleet_proto::clock::now_ms;
use fleet_proto::joinfile::Secret;
use fleet_proto::pin::{self, CertInfo};
use fleet_proto::protocol::{self, Command, Down, MAX_UNIDENTIFIED_FRAME, Opening, Up};
use fleet_proto::version::{Incompatible, Versions};
use fleet_proto::{Digest, NodeId, UploadId};
use std::time::Duration;
use tokio::net::TcpStream;
use tokio_rustls::server::TlsStream;

/// From accepting a connection to its first request: a peer that has not proven who it is gets
/// little time and little memory (see [`MAX_UNIDENTIFIED_FRAME`]).
pub(super) const FIRST_MESSAGE_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a connection waits for its turn to shake hands: half of what a node gives its
/// handshake ([`fleet_proto::dial::HANDSHAKE_TIMEOUT`]), so one that waited longer is dropped
/// before any work, not answered once gone. Long enough for a restart's returning nodes to be
/// served in the order they came: at 5 s, 2 510 of them were dropped and dialed again.
const HANDSHAKE_TURN_WAIT: Duration =
    Duration::from_secs(fleet_proto::dial::HANDSHAKE_TIMEOUT.as_secs() / 2);

type Tls = TlsStream<TcpStream>;

/// Err carries why the connection was dropped, for the coordinator's own log only.
pub(super) async fn handle_tls(
    coordinator: &Coordinator,
    config: &ServeConfig,
    tls: tokio_rustls::TlsAcceptor,
    stream: TcpStream,
    source: std::net::SocketAddr,
    admitted: Admission,
    stopping: Stopping,
) -> Result<(), Dropped> {
    // The handshake and the first read in an allocation of their own, freed once they are done:
    // their states would otherwise be part of every session's task for as long as it lives.
    let Opened {
        stream,
        cert,
        first,
    } = Box::pin(open(coordinator, tls, stream)).await?;
    // Another coordinator of the fleet proves the fleet's own key.
    let peer = cert.key == coordinator.key().public_key_raw();
    // What a source that failed joins paid at accept comes back unless this is a failed join.
    let joins = coordinator.joins();
    let Opening { first, speaks } = first;
    let Some(protocol) = Versions::SPOKEN.common(speaks) else {
        joins.not_failed(source.ip(), admitted);
        return Box::pin(refuse_unspoken(
            coordinator,
            stream,
            &cert,
            peer,
            first,
            speaks,
        ))
        .await;
    };
    if !matches!(first, Up::Join { .. }) {
        joins.not_failed(source.ip(), admitted);
    }
    // Every connection's task is as large as the largest of these; a session lives for weeks
    // and the rest for one transfer, so only the session's future is held in place and each
    // other one gets an allocation of its own while it lasts.
    match first {
        Up::Join { token, .. } => {
            let joined = Box::pin(join(coordinator, config, stream, &cert, &token)).await;
            match &joined {
                Err(Dropped::NotAllowed(_)) => joins.failed(source.ip(), admitted),
                _ => joins.not_failed(source.ip(), admitted),
            }
            joined
        }
        Up::Hello { node_id } => {
            link::session(
                coordinator,
                config,
                stream,
                cert,
                node_id,
                protocol,
                stopping,
            )
            .await
        }
        Up::Relay { node_id, command } if peer => {
            Box::pin(relay(coordinator, stream, &node_id, command)).await
        }
        Up::Hold { digest } if peer => Box::pin(hold(coordinator, stream, &digest)).await,
        Up::Push { size } if peer => {
            let mut stream = stream;
            Box::pin(coordinator.receive_push(&mut stream, size)).await
        }
        Up::Copy { digest, offset } if peer => {
            let mut stream = stream;
            Box::pin(coordinator.send_content(&mut stream, Asker::Peer, &digest, offset)).await
        }
        Up::Fetch {
            node_id,
            digest,
            offset,
            ticket,
        } => {
            let fetched = fetch(
                coordinator,
                stream,
                &cert,
                &node_id,
                &digest,
                offset,
                ticket,
            );
            Box::pin(fetched).await
        }
        Up::Upload {
            node_id,
            upload,
            size,
        } => Box::pin(receive(coordinator, stream, &cert, &node_id, &upload, size)).await,
        _ => Err(Dropped::Protocol(
            "a first message that is neither join, hello, fetch nor upload".into(),
        )),
    }
}

/// A peer asks this coordinator to keep a copy of a blob: it copies it from whichever coordinator
/// holds it, and says so once it is held.
async fn hold(coordinator: &Coordinator, mut stream: Tls, digest: &Digest) -> Result<(), Dropped> {
    match coordinator.ensure_blob(digest).await {
        Ok(()) => Ok(protocol::write_msg(&mut stream, &Down::Stored { digest: *digest }).await?),
        Err(e) => refuse(&mut stream, e.to_string()).await,
    }
}

/// A join: the token is spent for this key (or was, by the same key, whose answer was lost).
async fn join(
    coordinator: &Coordinator,
    config: &ServeConfig,
    mut stream: Tls,
    cert: &CertInfo,
    token: &Secret,
) -> Result<(), Dropped> {
    #[cfg(debug_assertions)]
    panic_when_asked(token);
    let key = pin::key_text(&cert.key);
    let id = node_id(&cert.key);
    let now = now_ms();
    let lease_until = now + config.lease.as_millis() as u64;
    let (hash, key_for_store) = (token_hash(&token.0), key.clone());
    let redeemed = coordinator
        .with_store(move |store| store.redeem(&hash, &key_for_store, &id, now, lease_until))
        .await?
        .ok_or_else(|| {
            Dropped::NotAllowed("a join with an unknown, expired or already spent token".into())
        })?;
    let node = redeemed.node;
    if redeemed.first {
        tracing::info!(node_id = %node.id, name = ?node.name, public_key = %key, "node joined");
    } else {
        tracing::info!(node_id = %node.id, "answered a join again for the same key (its answer was lost)");
    }
    let joined = Down::Joined {
        node_id: node.id,
        speaks: Versions::SPOKEN,
    };
    Ok(protocol::write_msg(&mut stream, &joined).await?)
}

/// A first message from a peer that shares no protocol version with this coordinator: it is
/// told so in a message it reads, and a node's record says so for `nodes`.
async fn refuse_unspoken(
    coordinator: &Coordinator,
    mut stream: Tls,
    cert: &CertInfo,
    peer: bool,
    first: Up,
    speaks: Versions,
) -> Result<(), Dropped> {
    let versions = Incompatible {
        agent: speaks,
        coordinator: Versions::SPOKEN,
    };
    let line = match peer {
        true => format!(
            "the asking coordinator speaks protocol {speaks} and this one {}: finish the upgrade of the fleet's coordinators",
            Versions::SPOKEN
        ),
        false => versions.to_string(),
    };
    let session = matches!(first, Up::Join { .. } | Up::Hello { .. });
    let told = match (session, speaks == Versions::UNSTATED) {
        (true, false) => Down::Incompatible { versions },
        // A peer of the release that stated no versions knows neither that answer nor its fields.
        (true, true) => Down::Unavailable {
            message: line.clone(),
        },
        (false, _) => Down::ContentRefused {
            message: line.clone(),
        },
    };
    if let Up::Hello { node_id } = &first
        && live_node(coordinator, cert, node_id).await.is_ok()
    {
        let id = node_id.clone();
        let recorded = coordinator
            .with_store(move |store| store.refuse_protocol(&id, versions))
            .await;
        if let Err(e) = recorded {
            tracing::warn!(%node_id, "recording a refused protocol failed: {e}");
        }
    }
    protocol::write_msg(&mut stream, &told).await?;
    Err(Dropped::Protocol(line))
}

/// A test build's hook: a join with the token in `FLEET_TEST_PANIC_ON_TOKEN` panics in its task,
/// so a test proves a panic takes down one connection, not the coordinator.
#[cfg(debug_assertions)]
fn panic_when_asked(token: &Secret) {
    if std::env::var("FLEET_TEST_PANIC_ON_TOKEN").is_ok_and(|t| t == token.0) {
        panic!("the test hook FLEET_TEST_PANIC_ON_TOKEN asked for a panic in a join");
    }
}

/// A peer's command for a node whose session this coordinator holds.
async fn relay(
    coordinator: &Coordinator,
    mut stream: Tls,
    node_id: &NodeId,
    command: Command,
) -> Result<(), Dropped> {
    let answer = coordinator.relayed(node_id, command).await;
    Ok(protocol::write_msg(&mut stream, &Down::Relayed { answer }).await?)
}

/// A node's fetch of content by digest, from `offset`; an artifact's with its one-time ticket.
async fn fetch(
    coordinator: &Coordinator,
    mut stream: Tls,
    cert: &CertInfo,
    node_id: &NodeId,
    digest: &Digest,
    offset: u64,
    ticket: Option<String>,
) -> Result<(), Dropped> {
    live_node(coordinator, cert, node_id).await?;
    // Content imported through another coordinator of the fleet is copied here first.
    if let Err(e) = coordinator.ensure_blob(digest).await {
        tracing::warn!(%node_id, %digest, "content not found in the fleet: {e}");
    }
    if let Some(ticket) = ticket
        && let Err(refusal) = coordinator.tickets().spend(&ticket, node_id, digest)
    {
        return refuse(&mut stream, refusal.to_string()).await;
    }
    coordinator
        .send_content(&mut stream, Asker::Node(node_id), digest, offset)
        .await
}

/// A node's upload of a collected file, accepted only under the name its collect minted.
async fn receive(
    coordinator: &Coordinator,
    mut stream: Tls,
    cert: &CertInfo,
    node_id: &NodeId,
    upload: &UploadId,
    size: u64,
) -> Result<(), Dropped> {
    live_node(coordinator, cert, node_id).await?;
    let (lock, place) = match coordinator.uploads().expected(upload, node_id) {
        Ok(expected) => expected,
        Err(refusal) => return refuse(&mut stream, refusal.to_string()).await,
    };
    let _one_try_at_a_time = lock.lock().await;
    coordinator
        .receive_content(&mut stream, node_id, upload, size, place)
        .await
}

/// A connection past its handshake, with its client's certificate and its first message.
struct Opened {
    stream: Tls,
    cert: CertInfo,
    first: Opening,
}

/// The TLS handshake, its turn first (within [`HANDSHAKE_TURN_WAIT`]), then the first message,
/// each within [`FIRST_MESSAGE_TIMEOUT`].
async fn open(
    coordinator: &Coordinator,
    tls: tokio_rustls::TlsAcceptor,
    stream: TcpStream,
) -> Result<Opened, Dropped> {
    let turn = tokio::time::timeout(HANDSHAKE_TURN_WAIT, coordinator.handshakes().acquire())
        .await
        .map_err(|_| Dropped::NoTurn(HANDSHAKE_TURN_WAIT))?
        .expect("never closed");
    let mut stream = tokio::time::timeout(FIRST_MESSAGE_TIMEOUT, tls.accept(stream))
        .await
        .map_err(|_| Dropped::HandshakeTimeout)?
        .map_err(Dropped::Handshake)?;
    drop(turn);
    let cert = peer_cert(&stream).ok_or(Dropped::NoClientCertificate)?;
    let first = tokio::time::timeout(
        FIRST_MESSAGE_TIMEOUT,
        protocol::read_msg_within::<_, Opening>(&mut stream, MAX_UNIDENTIFIED_FRAME),
    )
    .await
    .map_err(|_| Dropped::NoRequest)??
    .ok_or(Dropped::ClosedEarly)?;
    Ok(Opened {
        stream,
        cert,
        first,
    })
}

fn peer_cert(stream: &Tls) -> Option<CertInfo> {
    let certs = stream.get_ref().1.peer_certificates()?;
    pin::cert_info(certs.first()?).ok()
}

/// A content connection of a node the operator ended is refused: its tickets are void.
async fn live_node(
    coordinator: &Coordinator,
    cert: &CertInfo,
    node_id: &NodeId,
) -> Result<(), Dropped> {
    // A node in session here with this key was checked against its record when the session
    // opened: a wave of fetches after a dispatch costs no store read each.
    if coordinator.sessions().holds_with_key(node_id, &cert.key) {
        return Ok(());
    }
    match known_node(coordinator, cert, node_id).await?.ended {
        Some(ending) => Err(ended(node_id, ending.end)),
        None => Ok(()),
    }
}
