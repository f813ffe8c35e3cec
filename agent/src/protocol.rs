//! The node protocol's messages and their framing: a u32 big-endian length, then JSON, bounded.
use crate::facts::Facts;
use crate::joinfile::Secret;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The largest message either side accepts.
pub const MAX_FRAME: usize = 16 << 20;

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
        node_id: String,
    },
    Facts {
        facts: Facts,
    },
    Heartbeat,
    /// The answer to a command, recorded by the agent before it was sent.
    Result {
        op: String,
        result: serde_json::Value,
    },
    /// A run state change from the node's spool; the coordinator dedupes by `event.id`.
    Event {
        event: crate::state::Event,
    },
}

/// Coordinator to agent.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Down {
    Joined {
        node_id: String,
    },
    /// The session is open. `generation` is its fencing token: it grows with every session, and
    /// anything stamped with an older one is refused.
    Welcome {
        generation: u64,
        heartbeat_ms: u64,
        lease_ms: u64,
    },
    /// Work for the node, with an operation id the node records before answering, and the
    /// session's generation for fencing.
    Command {
        op: String,
        generation: u64,
        command: Command,
    },
    /// Every event with an id up to and including `up_to` is stored; the node may forget them.
    Ack {
        up_to: u64,
    },
}

/// What the coordinator asks of a node.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Command {
    /// Stage a program by digest, carrying its bytes.
    Stage {
        digest: String,
        program_b64: String,
    },
    Start(StartRun),
    Stop {
        run_id: String,
    },
    Status {
        run_id: String,
    },
    /// Read a file from a run's folder.
    Collect {
        run_id: String,
        path: String,
    },
    Facts,
}

impl Command {
    /// Whether answering twice would do something twice; only those are recorded as applied.
    pub fn mutates(&self) -> bool {
        matches!(
            self,
            Command::Stage { .. } | Command::Start(_) | Command::Stop { .. }
        )
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StartRun {
    pub run_id: String,
    /// `sha256:HEX` of a staged program.
    pub program: String,
    #[serde(flatten)]
    pub options: RunOptions,
}

/// How a program runs, the same from the operator's request through the coordinator's row to the
/// node's start command (flattened into each, so the JSON keeps these fields at its top level).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RunOptions {
    #[serde(default)]
    pub argv: Vec<String>,
    pub timeout_ms: Option<u64>,
    pub output_limit: Option<u64>,
    #[serde(default)]
    pub env: Vec<(String, String)>,
    /// Input files as `(NAME, base64 content)`.
    #[serde(default)]
    pub inputs: Vec<(String, String)>,
}

/// A command's answer: `{"ok": ...}` or `{"error": "one line"}`.
pub fn ok(value: serde_json::Value) -> serde_json::Value {
    serde_json::json!({ "ok": value })
}

pub fn error(message: impl std::fmt::Display) -> serde_json::Value {
    serde_json::json!({ "error": message.to_string() })
}

#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("a message of {0} bytes is over the {MAX_FRAME} byte limit")]
    TooLarge(usize),
    #[error("a malformed message: {0}")]
    Malformed(String),
}

pub async fn write_msg<W: AsyncWrite + Unpin, T: Serialize>(
    w: &mut W,
    msg: &T,
) -> Result<(), FrameError> {
    let body = serde_json::to_vec(msg).expect("protocol messages serialize");
    if body.len() > MAX_FRAME {
        return Err(FrameError::TooLarge(body.len()));
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
    let mut len = [0u8; 4];
    match r.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let len = u32::from_be_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(FrameError::TooLarge(len));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await?;
    serde_json::from_slice(&body)
        .map(Some)
        .map_err(|e| FrameError::Malformed(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert!(matches!(err, FrameError::TooLarge(_)));
    }
}
