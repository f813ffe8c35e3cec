//! What a coordinator call can fail with, each one line that says what to do.
use crate::folder::KEY_FILE;
use crate::store::StoreError;
use fleet_content::ContentError;
use fleet_proto::dial::DialError;
use fleet_proto::protocol::FrameError;
use fleet_proto::{Digest, NodeId};
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum CoordinatorError {
    #[error("cannot use the coordinator data directory {}: {cause}", path.display())]
    DataDir {
        path: PathBuf,
        cause: std::io::Error,
    },
    #[error("the coordinator key {} is corrupt ({reason}): restore it; a new key would orphan every node", path.display())]
    CorruptKey { path: PathBuf, reason: String },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(
        "no address to put in the join file: pass --address HOST:PORT (the coordinator is not serving from this data directory)"
    )]
    NoAddress,
    #[error("{0}")]
    Request(String),
    #[error(transparent)]
    Selector(#[from] crate::placement::SelectorError),
    #[error(transparent)]
    Image(#[from] fleet_proto::run::ImageRefError),
    #[error(transparent)]
    SigningKey(#[from] fleet_proto::release::SigningKeyError),
    /// The node refused the command: its class is what a caller acts on, its line what people read.
    #[error(transparent)]
    Refused(#[from] fleet_proto::protocol::Refusal),
    /// Another coordinator of the fleet, which holds the node's session, could not be used.
    #[error(transparent)]
    Peer(#[from] PeerError),
    #[error(
        "--store takes a PostgreSQL URL, postgres://USER[:PASSWORD]@HOST[:PORT]/DATABASE, not `{0}`; leave it out for the embedded store in the data directory"
    )]
    StoreChoice(String),
    /// The data folder's key is not the one the fleet's store was first served with.
    #[error(
        "the coordinator key in {} is {ours}, but the store {store} belongs to the fleet of {fleet}: copy the fleet's coordinator.key into this data folder (or pass the data folder of a coordinator of that fleet), or use a store of its own"
    , data.display())]
    ForeignKey {
        data: PathBuf,
        ours: String,
        fleet: String,
        store: String,
    },
    #[error("cannot read the bundle {}: {cause}: build it with `cargo xtask dist`", path.display())]
    Bundle {
        path: PathBuf,
        cause: std::io::Error,
    },
}

/// Why this coordinator ended a connection early, by class: for its own log only (a node learns
/// what it must act on from the protocol's own messages).
#[derive(Debug, thiserror::Error)]
pub(crate) enum Dropped {
    #[error("the handshake timed out")]
    HandshakeTimeout,
    #[error("no turn to shake hands within {} s: the coordinator is busy with others' handshakes", .0.as_secs())]
    NoTurn(std::time::Duration),
    #[error("the handshake failed: {0}")]
    Handshake(std::io::Error),
    #[error("no client certificate")]
    NoClientCertificate,
    #[error("no request within the timeout")]
    NoRequest,
    #[error("closed before a request")]
    ClosedEarly,
    /// Reading or writing a message failed.
    #[error(transparent)]
    Frame(#[from] FrameError),
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The other side is not allowed this: an unknown token, node or key.
    #[error("{0}")]
    NotAllowed(String),
    /// The other side broke the protocol: a malformed or misplaced message, a bad certificate.
    #[error("{0}")]
    Protocol(String),
    /// A node's session ended without closing: lapsed, silent, cut.
    #[error("{0}")]
    SessionEnded(String),
    /// Content was refused (the node was told why), or its transfer stopped.
    #[error("{0}")]
    Content(String),
}

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
    /// Fewer coordinators hold `digest` than the fleet keeps copies on; what the others answered.
    #[error("{digest} is held by {held} coordinator(s) of the {wanted} asked for ({answers})")]
    FewCopies {
        digest: Digest,
        held: usize,
        wanted: usize,
        answers: String,
    },
    /// Every coordinator of the fleet was asked; each failure, in order.
    #[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Each(Vec<PeerError>),
}

impl From<fleet_cli::blocking::Unfinished> for CoordinatorError {
    fn from(e: fleet_cli::blocking::Unfinished) -> CoordinatorError {
        CoordinatorError::Request(e.to_string())
    }
}
