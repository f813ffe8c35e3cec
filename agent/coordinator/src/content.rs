//! The coordinator's side of the content path: a node's fetch (content from the blob store,
//! from the offset the node asks) and upload (a collected file into the blob store), each on a
//! connection of its own, authenticated as a session is. The blob store is content-addressed
//! files under the data folder (`blobs/sha256/HEX`); the store's reference counts decide when
//! a blob is no longer referred to, and [`Coordinator::sweep_blobs`] removes it then. A collect's
//! upload lands apart (`blobs/collected/NAME`), for the CLI to move to `--out`.
use crate::Coordinator;
use crate::error::{CoordinatorError, Dropped};
use fleet_content::{self as content, Landing, Place, Stopped, Streamed};
use fleet_proto::protocol::{self, Down, Up};
use fleet_proto::{Digest, NodeId, UploadId};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncSeekExt, AsyncWrite, AsyncWriteExt};

/// A blob no run refers to is removed once it is this old: the grace covers a `run` that
/// imported it and has not recorded its set yet. What a transfer left unfinished (a partial or
/// untaken upload, a temporary file) goes once untouched this long.
pub const BLOB_GRACE: Duration = Duration::from_secs(600);

/// How long an upload's digest may take to follow its last byte.
const SENT_WAIT: Duration = Duration::from_secs(30);

/// Who asked for content: a node, or another coordinator of the fleet copying a blob.
#[derive(Clone, Copy)]
pub(crate) enum Asker<'a> {
    Node(&'a NodeId),
    Peer,
}

impl std::fmt::Display for Asker<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Asker::Node(node_id) => write!(f, "{node_id}"),
            Asker::Peer => f.write_str("another coordinator"),
        }
    }
}

impl Coordinator {
    /// Sends the content of `digest` from byte `offset`: [`Down::Content`], then the bytes.
    pub(crate) async fn send_content<S: AsyncRead + AsyncWrite + Unpin>(
        &self,
        stream: &mut S,
        to: Asker<'_>,
        digest: &Digest,
        offset: u64,
    ) -> Result<(), Dropped> {
        let path = self.blobs().path(digest);
        let mut file = match tokio::fs::File::open(&path).await {
            Ok(file) => file,
            Err(e) => {
                let message = format!(
                    "the coordinator holds no content {digest} ({e}); run it again with the file"
                );
                return refuse(stream, message).await;
            }
        };
        let size = file.metadata().await?.len();
        if offset > size {
            let message = format!(
                "content {digest} has {size} bytes, fewer than the offset {offset} asked for"
            );
            return refuse(stream, message).await;
        }
        file.seek(std::io::SeekFrom::Start(offset)).await?;
        protocol::write_msg(stream, &Down::Content { size }).await?;
        // The node checks what it receives: no hash here.
        let streamed = content::stream_exact(&mut file, stream, size - offset, None).await;
        let sent = match streamed {
            Streamed::Done => size - offset,
            Streamed::Cut { got, .. } | Streamed::Write { got, .. } => got,
        };
        self.traffic().sent(sent);
        tracing::info!(%to, %digest, offset, bytes = sent, "content sent");
        match streamed {
            Streamed::Done => {
                let _ = stream.shutdown().await;
                Ok(())
            }
            Streamed::Cut { cause, .. } => Err(Dropped::Content(format!(
                "reading blob {digest} failed: {cause}"
            ))),
            Streamed::Write { cause, .. } => Err(Dropped::Content(format!(
                "sending {digest} to {to} stopped: {cause}"
            ))),
        }
    }

    /// Receives the collect `upload`: `size` bytes, from what an earlier try left (answered
    /// first as [`Down::UploadFrom`]), hashed as they land, then the digest the node hashed
    /// them to ([`Up::Sent`]); only when both agree is the upload put in place as `place`, and
    /// answered [`Down::Stored`]. A cut try keeps what arrived, so the next resumes.
    pub(crate) async fn receive_content<S: AsyncRead + AsyncWrite + Unpin>(
        &self,
        stream: &mut S,
        node_id: &NodeId,
        upload: &UploadId,
        size: u64,
        place: Place,
    ) -> Result<(), Dropped> {
        let stopped = |got: u64, cause: String| {
            format!(
                "the upload {upload} from {node_id} stopped after {got} of {size} bytes: {cause}; the node's next try resumes from there"
            )
        };
        let result = async {
            let mut landing = (Landing::upload(self.blobs(), upload, size, place).await)
                .map_err(|e| self.stopped(e))?;
            let held = landing.held();
            protocol::write_msg(stream, &Down::UploadFrom { offset: held })
                .await
                .map_err(|e| e.to_string())?;
            match landing.receive(stream, held, size).await {
                Ok(got) => self.traffic().received(got),
                Err(Stopped::Cut { got, cause }) => {
                    self.traffic().received(got - held);
                    tracing::info!(%node_id, %upload, offset = held, bytes = got - held, "content received");
                    return Err(stopped(got, cause));
                }
                Err(e) => return Err(self.stopped(e)),
            }
            let sent = match tokio::time::timeout(SENT_WAIT, protocol::read_msg::<_, Up>(stream)).await {
                Ok(Ok(Some(Up::Sent { digest }))) => digest,
                Ok(Ok(Some(other))) => {
                    return Err(format!("the node sent {other:?} after its upload, not its digest; run an agent of the coordinator's version"));
                }
                Ok(Err(e)) => return Err(stopped(size, e.to_string())),
                Ok(Ok(None)) | Err(_) => return Err(stopped(size, "no digest after the bytes".into())),
            };
            tracing::info!(%node_id, %upload, digest = %sent, offset = held, bytes = size - held, "content received");
            match landing.finish(&sent).await {
                Ok(_) => Ok(sent),
                Err(Stopped::Mismatch { got }) => Err(format!(
                    "content {sent}: what arrived hashes to {got}; removed it: if the run still writes the file, collect it once it stopped"
                )),
                Err(e) => Err(self.stopped(e)),
            }
        }
        .await;
        match result {
            Ok(digest) => Ok(protocol::write_msg(stream, &Down::Stored { digest }).await?),
            Err(message) => refuse(stream, message).await,
        }
    }

    /// Receives a copy an operator command pushes while it imports content (it proves the
    /// fleet's key): `size` bytes into a temporary file, hashed as they land, then the digest
    /// the command hashed them to ([`Up::Sent`]); kept as a blob only when both agree, and
    /// answered [`Down::Stored`]. A cut push leaves nothing: the copy is then made by digest.
    pub(crate) async fn receive_push<S: AsyncRead + AsyncWrite + Unpin>(
        &self,
        stream: &mut S,
        size: u64,
    ) -> Result<(), Dropped> {
        let result = async {
            let mut landing = Landing::push(self.blobs())
                .await
                .map_err(|e| self.stopped(e))?;
            // Written direct and synced while the pusher syncs its own copy, before its digest.
            match landing.receive(stream, 0, size).await {
                Ok(got) => self.traffic().received(got),
                Err(Stopped::Cut { got, cause }) => {
                    return Err(format!(
                        "a pushed copy stopped after {got} of {size} bytes: {cause}"
                    ));
                }
                Err(e) => return Err(self.stopped(e)),
            }
            let sent =
                match tokio::time::timeout(SENT_WAIT, protocol::read_msg::<_, Up>(stream)).await {
                    Ok(Ok(Some(Up::Sent { digest }))) => digest,
                    _ => return Err("a pushed copy ended without its digest".to_string()),
                };
            match landing.finish(&sent).await {
                Ok(_) => {}
                Err(Stopped::Mismatch { got }) => {
                    return Err(format!(
                        "a pushed copy of {sent} hashes to {got}; dropped it"
                    ));
                }
                Err(e) => return Err(self.stopped(e)),
            }
            tracing::info!(digest = %sent, bytes = size, "content pushed and checked");
            Ok(sent)
        }
        .await;
        match result {
            Ok(digest) => Ok(protocol::write_msg(stream, &Down::Stored { digest }).await?),
            Err(message) => refuse(stream, message).await,
        }
    }

    /// A landing's stop as a refusal's reason, where the caller has no words of its own for it.
    fn stopped(&self, stopped: Stopped) -> String {
        match stopped {
            Stopped::Disk(e) => blob_disk(self.blobs(), e),
            Stopped::Cut { got, cause } => {
                format!("the transfer stopped after {got} bytes: {cause}")
            }
            Stopped::Mismatch { got } => format!("what arrived hashes to {got}; removed it"),
        }
    }

    /// Removes blobs no stored run refers to, once they are older than [`BLOB_GRACE`].
    pub fn sweep_blobs(&self, grace: Duration) -> Result<(), CoordinatorError> {
        let in_blobs = |cause| CoordinatorError::DataDir {
            path: self.blobs().root().to_path_buf(),
            cause,
        };
        let old: Vec<Digest> = (self.blobs().list().map_err(in_blobs)?)
            .into_iter()
            .filter(|(_, age)| *age >= grace)
            .map(|(d, _)| d)
            .collect();
        for digest in self.store().unreferenced(&old)? {
            let _ = std::fs::remove_file(self.blobs().path(&digest));
            tracing::info!(%digest, "removed a blob no run refers to");
        }
        for path in self.blobs().remove_stale(grace).map_err(in_blobs)? {
            tracing::info!(path = %path.display(), "removed what a transfer left unfinished");
        }
        Ok(())
    }
}

/// A refusal on a content connection: sent to the node, and the reason for the log.
pub(crate) async fn refuse<S: AsyncWrite + Unpin>(
    stream: &mut S,
    message: String,
) -> Result<(), Dropped> {
    let _ = protocol::write_msg(
        stream,
        &Down::ContentRefused {
            message: message.clone(),
        },
    )
    .await;
    Err(Dropped::Content(message))
}

fn blob_disk(blobs: &content::Blobs, e: std::io::Error) -> String {
    match content::is_no_space(&e) {
        true => format!(
            "the coordinator's disk holding {} is full ({e}); free space there and collect again",
            blobs.root().display()
        ),
        false => format!("cannot write under {} ({e})", blobs.root().display()),
    }
}
