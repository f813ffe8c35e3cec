//! The node protocol's messages and their framing: a u32 big-endian length, then JSON, bounded.
use crate::facts::Facts;
use crate::joinfile::Secret;
use crate::run::{Event, RunOptions, RunReport, RunState, Workload};
use crate::version::{Incompatible, Versions};
use fleet_vocab::{Digest, NodeId, OpId, RunId, UploadId};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The largest message either side accepts from an identified peer.
pub const MAX_FRAME: usize = 16 << 20;

/// The first message of every connection: what it is for, and the protocol versions its sender
/// speaks. On the wire it is that message with a `speaks` field beside its own; a sender of
/// release 0.1.0 wrote none.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Opening {
    #[serde(flatten)]
    pub first: Up,
    #[serde(default = "Versions::unstated")]
    pub speaks: Versions,
}

impl Opening {
    /// `first`, stating what this build speaks.
    pub fn new(first: Up) -> Opening {
        Opening {
            first,
            speaks: Versions::SPOKEN,
        }
    }
}

/// Agent to coordinator.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Up {
    /// The first message of a join connection; the token travels only inside the pinned TLS session.
    Join {
        token: Secret,
        name: Option<String>,
        #[serde(default)]
        labels: BTreeMap<String, String>,
    },
    /// The first message of a session connection.
    Hello {
        node_id: NodeId,
    },
    /// The first message of a content connection: send the content of `digest` from byte
    /// `offset` (what the node already holds of it), as raw bytes after [`Down::Content`].
    Fetch {
        node_id: NodeId,
        digest: Digest,
        offset: u64,
        /// For an artifact: the one-time ticket the coordinator minted for this fetch.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ticket: Option<String>,
    },
    /// The first message of an upload for the collect the coordinator named `upload`: the
    /// coordinator answers [`Down::UploadFrom`] (what it already holds of it), the node sends
    /// the rest of the `size` bytes raw, then [`Up::Sent`]; the coordinator answers
    /// [`Down::Stored`] once what it holds hashes to that digest and is in place.
    Upload {
        node_id: NodeId,
        upload: UploadId,
        size: u64,
    },
    /// From another coordinator of the same fleet (it proves the fleet's key): the first message
    /// of a copy of the blob `digest` into its own blob store, from `offset`, answered as a
    /// [`Up::Fetch`] is.
    Copy {
        digest: Digest,
        offset: u64,
    },
    /// From another coordinator of the same fleet (it proves the fleet's key): keep a copy of
    /// the blob `digest`, copied from whichever coordinator holds it; answered [`Down::Stored`]
    /// once it is held, checked, or [`Down::ContentRefused`].
    Hold {
        digest: Digest,
    },
    /// From the fleet's key (an operator command importing content): the first message of a
    /// copy pushed while it is imported, `size` raw bytes then [`Up::Sent`]; answered
    /// [`Down::Stored`] once what arrived hashes to that digest and is kept as a blob.
    Push {
        size: u64,
    },
    /// From another coordinator of the same fleet (it proves the fleet's key): pass `command` to
    /// the node whose session this coordinator holds, and answer [`Down::Relayed`].
    Relay {
        node_id: NodeId,
        command: Command,
    },
    /// After an upload's bytes: the digest the node hashed them to, as it sent them.
    Sent {
        digest: Digest,
    },
    Facts {
        facts: Facts,
    },
    Heartbeat,
    /// The answer to a command, recorded by the agent before it was sent.
    Result {
        op: OpId,
        answer: Answer,
    },
    /// A run state change from the node's spool; the coordinator dedupes by `event.id`.
    Event {
        event: Event,
    },
}

/// Coordinator to agent.
// Wire messages live for one send or one receive; boxing the large variant would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Down {
    Joined {
        node_id: NodeId,
        /// The versions the coordinator speaks (absent from one of release 0.1.0).
        #[serde(default = "Versions::unstated")]
        speaks: Versions,
    },
    /// The session is open. `generation` is its fencing token: it grows with every session, and
    /// anything stamped with an older one is refused.
    Welcome {
        generation: u64,
        heartbeat_ms: u64,
        lease_ms: u64,
        /// Every coordinator of the fleet now (`host:port`), for the node to reconnect to another
        /// when this one goes away; empty from a coordinator that does not say.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        coordinators: Vec<String>,
        /// The versions the coordinator speaks (absent from one of release 0.1.0).
        #[serde(default = "Versions::unstated")]
        speaks: Versions,
    },
    /// Instead of a welcome or a join's answer: the two sides share no protocol version. Sent
    /// only to a peer that stated its versions (one of 0.1.0 gets [`Down::Unavailable`]).
    Incompatible { versions: Incompatible },
    /// Work for the node, with an operation id the node records before answering, and the
    /// session's generation for fencing.
    Command {
        op: OpId,
        generation: u64,
        command: Command,
    },
    /// Every event with an id up to and including `up_to` is stored; the node may forget them.
    Ack { up_to: u64 },
    /// On a content connection: the content is `size` bytes in all, and the bytes from the
    /// asked offset follow raw.
    Content { size: u64 },
    /// On an upload connection: send from byte `offset` (what an earlier, cut try left).
    UploadFrom { offset: u64 },
    /// On an upload connection: the bytes landed, checked, under their digest.
    Stored { digest: Digest },
    /// A content connection refused, in one line.
    ContentRefused { message: String },
    /// To another coordinator: the node's answer to a relayed command.
    Relayed { answer: Answer },
    /// Instead of a welcome: this coordinator cannot serve a session now (its store does not
    /// answer), and why; the node tries again, here or at another coordinator.
    Unavailable { message: String },
    /// In an open session: the fleet's coordinators now (`host:port`), sent whenever the set
    /// changes, so a node learns a coordinator that came after its welcome.
    Coordinators { coordinators: Vec<String> },
    /// The fleet's operator ended this node: its key is refused from now on, on every
    /// coordinator. Sent instead of a welcome, or in an open session, which then ends.
    Ended { end: NodeEnd },
    /// In an open session, which then ends: this coordinator stops serving on its operator's
    /// word (SIGTERM), most often to start again; the node dials it again for a while before it
    /// moves on. A coordinator that dies says nothing, and its nodes move on at once. Sent from
    /// [`ProtocolVersion::STOPPING_SAID`] on.
    ///
    /// [`ProtocolVersion::STOPPING_SAID`]: crate::version::ProtocolVersion::STOPPING_SAID
    Stopping,
}

/// How the operator ended a node; either way its key is refused from then on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeEnd {
    /// Taken out of the fleet on purpose (`fleet-coordinator retire`): the agent removes its
    /// state and its unit and stops.
    Retired,
    /// Its key is no longer trusted (`fleet-coordinator revoke`): the agent stops, and keeps
    /// what it holds for whoever looks at the machine.
    Revoked,
}

impl NodeEnd {
    /// As `nodes` shows it, and the reason a run it held was lost for.
    pub fn as_str(self) -> &'static str {
        match self {
            NodeEnd::Retired => "retired",
            NodeEnd::Revoked => "revoked",
        }
    }
}

/// What the coordinator asks of a node.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Command {
    /// Stage a program by digest; the node fetches the bytes it lacks on a content connection.
    Stage {
        digest: Digest,
    },
    Start(StartRun),
    Stop {
        run_id: RunId,
    },
    Status {
        run_id: RunId,
    },
    /// Upload a file from a run's folder to the coordinator's blob store, refused past
    /// `max_bytes` when given.
    Collect {
        run_id: RunId,
        path: String,
        /// The coordinator's name for this collect's upload (what a resumed try continues).
        upload: UploadId,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max_bytes: Option<u64>,
    },
    Facts,
    /// Replicate one immutable artifact by digest into the node's artifact root, through the
    /// read minted for this one fetch; a command with none is refused.
    Replicate {
        digest: Digest,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        read: Option<MintedRead>,
    },
    /// Take this signed release: the node checks it itself, fetches its binaries by digest,
    /// installs them beside the running ones, swaps and restarts into them on trial (sent only
    /// in sessions of protocol 2 and later).
    Update {
        release: crate::release::ReleaseOffer,
    },
    /// Run the acceptance checks on itself and answer each (an agent before checks refuses the
    /// command as malformed).
    Check(crate::check::CheckRequest),
}

/// A read minted for one fetch: the node holds no standing credential to any store.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum MintedRead {
    /// A coordinator-issued ticket for its own blob store: valid once, for a short time.
    Ticket { ticket: String },
    /// An external HTTP URL (an object store's presigned URL, say), usable for `expires_in_ms`
    /// from when the node receives the command (a duration, so no clocks are compared).
    Url { url: String, expires_in_ms: u64 },
}

impl Command {
    /// Whether answering twice would do something twice; only those are recorded as applied.
    pub fn mutates(&self) -> bool {
        matches!(
            self,
            Command::Stage { .. }
                | Command::Start(_)
                | Command::Stop { .. }
                | Command::Update { .. }
        )
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StartRun {
    pub run_id: RunId,
    pub workload: Workload,
    /// The credential for pulling an image, in this command only: the node never records it
    /// (its record of the start leaves it out).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub registry_auth: Option<crate::run::RegistryAuth>,
    #[serde(flatten)]
    pub options: RunOptions,
}

/// A command's answer: what the node did, or why it refused. Recorded by the node as it was sent.
pub type Answer = Result<Reply, Refusal>;

/// What a node did, one variant per command.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Reply {
    Staged {
        digest: Digest,
    },
    Started {
        run_id: RunId,
        /// The run id was already claimed: nothing new was launched (a redelivery).
        already: bool,
    },
    Stopped {
        run_id: RunId,
    },
    Status {
        run_id: RunId,
        state: RunState,
        report: RunReport,
    },
    /// The file is in the coordinator's blob store under `digest`.
    Collected {
        digest: Digest,
        size: u64,
    },
    FactsSent,
    /// The artifact is in the artifact root, checked; `copy_ms` timed the whole copy (0 and no
    /// rate when it was there already).
    Replicated {
        digest: Digest,
        size: u64,
        copy_ms: u64,
        bytes_per_s: Option<u64>,
    },
    /// The release is installed and the node restarts into it, on trial: the outcome comes in
    /// its facts.
    Updating {
        from: u64,
        to: u64,
    },
    /// The checks' rows, and the node's clock as it answered (Unix ms) for the coordinator to
    /// compare with its own.
    Checked {
        rows: Vec<crate::check::CheckRow>,
        clock_ms: u64,
    },
}

/// Why a node refused a command: a class both sides match on, and one line for people.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct Refusal {
    pub class: RefusalClass,
    pub message: String,
}

impl Refusal {
    pub fn new(class: RefusalClass, message: impl std::fmt::Display) -> Refusal {
        Refusal {
            class,
            message: message.to_string(),
        }
    }
}

/// Refusals by class, so no side decides by wording. A class from a newer peer reads `other`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RefusalClass {
    /// The command came from a session older than the node's newest.
    Fenced,
    /// The command did not parse.
    Malformed,
    /// The program was never staged, or its bytes did not match.
    NotStaged,
    /// The node has no run with that id.
    UnknownRun,
    /// The run id was used by another start.
    RunIdTaken,
    /// A path would leave the run's folder.
    PathEscapes,
    /// The disk is full.
    NoSpace,
    /// The node cannot do this (a resource limit or workload its runtime does not support).
    Unsupported,
    /// The node's own store failed.
    Store,
    /// Relayed between coordinators: the one asked holds no session of the node (any more).
    NoSession,
    /// A release the node does not take: its signature, expiry, sequence, target or binaries.
    Release,
    /// The run could not start, or anything else; the message says why.
    #[serde(other)]
    Other,
}

/// Up to this many bytes the first frame of a connection may have, before its peer has proven
/// which node it is: a join or a hello is a few hundred bytes.
pub const MAX_UNIDENTIFIED_FRAME: usize = 16 << 10;

#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("a message of {size} bytes is over the {limit} byte limit")]
    TooLarge { size: usize, limit: usize },
    #[error("a malformed message: {0}")]
    Malformed(String),
}

pub async fn write_msg<W: AsyncWrite + Unpin, T: Serialize>(
    w: &mut W,
    msg: &T,
) -> Result<(), FrameError> {
    // Cannot fail: protocol messages are plain data with string keys, which always serialize.
    let body = serde_json::to_vec(msg).expect("protocol messages serialize");
    if body.len() > MAX_FRAME {
        return Err(FrameError::TooLarge {
            size: body.len(),
            limit: MAX_FRAME,
        });
    }
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend_from_slice(&body);
    w.write_all(&frame).await?;
    w.flush().await?;
    Ok(())
}

/// The next message, or None when the peer closed the connection cleanly between messages.
pub async fn read_msg<R: AsyncRead + Unpin, T: DeserializeOwned>(
    r: &mut R,
) -> Result<Option<T>, FrameError> {
    read_msg_within(r, MAX_FRAME).await
}

/// Like [`read_msg`] with a smaller limit. Memory grows with the bytes that really arrive, never
/// with the length a peer claims, so a peer that announces a large frame and stalls holds little.
pub async fn read_msg_within<R: AsyncRead + Unpin, T: DeserializeOwned>(
    r: &mut R,
    limit: usize,
) -> Result<Option<T>, FrameError> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let size = u32::from_be_bytes(len) as usize;
    if size > limit {
        return Err(FrameError::TooLarge { size, limit });
    }
    let mut body = Vec::with_capacity(size.min(64 << 10));
    let got = r.take(size as u64).read_to_end(&mut body).await?;
    if got < size {
        return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into());
    }
    serde_json::from_slice(&body)
        .map(Some)
        .map_err(|e| FrameError::Malformed(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_round_trip_typed() {
        let refused: Answer = Err(Refusal::new(
            RefusalClass::UnknownRun,
            "run r1 is not known",
        ));
        let json = serde_json::to_value(&refused).unwrap();
        assert_eq!(json["Err"]["class"], "unknown_run");
        let back: Answer = serde_json::from_value(json).unwrap();
        assert_eq!(back, refused);
        let newer = serde_json::json!({ "Err": { "class": "from_the_future", "message": "m" } });
        let back: Answer = serde_json::from_value(newer).unwrap();
        assert_eq!(back.unwrap_err().class, RefusalClass::Other);
    }

    #[tokio::test]
    async fn round_trip_and_limits() {
        let mut buf = Vec::new();
        write_msg(&mut buf, &Up::Heartbeat).await.unwrap();
        let got: Up = read_msg(&mut buf.as_slice()).await.unwrap().unwrap();
        assert!(matches!(got, Up::Heartbeat));
        let none: Option<Up> = read_msg(&mut &[][..]).await.unwrap();
        assert!(none.is_none());
        let huge = ((MAX_FRAME + 1) as u32).to_be_bytes();
        let err = read_msg::<_, Up>(&mut &huge[..]).await.unwrap_err();
        assert!(matches!(err, FrameError::TooLarge { .. }));
        let small = ((MAX_UNIDENTIFIED_FRAME + 1) as u32).to_be_bytes();
        let err = read_msg_within::<_, Up>(&mut &small[..], MAX_UNIDENTIFIED_FRAME)
            .await
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "a message of {} bytes is over the {MAX_UNIDENTIFIED_FRAME} byte limit",
                MAX_UNIDENTIFIED_FRAME + 1
            )
        );
        // A frame that claims more than arrives ends as a cut connection, not a huge buffer.
        let mut short = 1000u32.to_be_bytes().to_vec();
        short.extend_from_slice(b"{}");
        assert!(matches!(
            read_msg::<_, Up>(&mut short.as_slice()).await.unwrap_err(),
            FrameError::Io(_)
        ));
    }
}
