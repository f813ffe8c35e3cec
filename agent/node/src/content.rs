//! Content beside the session: each fetch or upload is one more outbound connection to the
//! coordinator, pinned as the session is, opened by a [`Up::Fetch`] or [`Up::Upload`] and then
//! raw bytes, hashed as they flow. A fetch keeps what arrived in a partial file per digest and
//! resumes from its length; content already held whole is never fetched again.
use crate::dial;
use crate::identity::Identity;
use fleet_content::{self as content, Blobs, ContentError, Streamed, land};
use fleet_proto::protocol::{self, Down, Opening, Up};
use fleet_proto::{Digest, UploadId};
use sha2::Sha256;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncSeekExt;
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

/// Tries per transfer; a cut connection (or a coordinator away for a moment) is tried again.
const TRIES: u32 = 6;
const FIRST_ANSWER: Duration = Duration::from_secs(30);

/// Where and as whom this node moves content, and its local store of it.
pub struct ContentLink {
    /// The coordinator the session talks to now.
    pub address: crate::dial::Coordinators,
    pub node_id: fleet_proto::NodeId,
    pub identity: Arc<Identity>,
    pub pinned: Vec<u8>,
    pub validity: Duration,
    pub blobs: Blobs,
}

impl ContentLink {
    /// The checked local copy of `digest`: fetched (or resumed) when not held whole yet.
    pub async fn fetch(&self, digest: &Digest) -> Result<PathBuf, ContentError> {
        self.fetch_into(&self.blobs, digest, None).await
    }

    /// Like [`ContentLink::fetch`], into `blobs`, presenting `ticket` when given (an artifact).
    pub async fn fetch_into(
        &self,
        blobs: &Blobs,
        digest: &Digest,
        ticket: Option<&str>,
    ) -> Result<PathBuf, ContentError> {
        retrying(digest, || {
            land(blobs, digest, |offset| async move {
                let mut stream = self
                    .open(
                        digest,
                        Up::Fetch {
                            node_id: self.node_id.clone(),
                            digest: *digest,
                            offset,
                            ticket: ticket.map(str::to_string),
                        },
                    )
                    .await?;
                match self.answer(digest, &mut stream).await? {
                    Down::Content { size } => Ok((stream, size, offset)),
                    other => Err(unexpected(digest, &other)),
                }
            })
        })
        .await
    }

    /// Sends `file` (its first `size` bytes; `what` names it in errors) as the collect the
    /// coordinator named `upload`, hashing it as it goes, and returns its digest, which the
    /// coordinator checked. A cut connection resumes from what the coordinator holds.
    pub async fn upload(
        &self,
        file: &std::fs::File,
        upload: &UploadId,
        what: &str,
        size: u64,
    ) -> Result<Digest, ContentError> {
        retrying(&what, || self.upload_once(file, upload, what, size)).await
    }

    async fn upload_once(
        &self,
        file: &std::fs::File,
        upload: &UploadId,
        what: &str,
        size: u64,
    ) -> Result<Digest, ContentError> {
        let failed = |reason: String| ContentError::Failed {
            content: what.to_string(),
            reason,
        };
        let unreadable = |cause: String| {
            failed(format!(
                "cannot read it to its end ({cause}); if the run still writes it, collect it once it stopped"
            ))
        };
        let mut stream = self
            .open(
                &what,
                Up::Upload {
                    node_id: self.node_id.clone(),
                    upload: upload.clone(),
                    size,
                },
            )
            .await?;
        let offset = match self.answer(&what, &mut stream).await? {
            Down::UploadFrom { offset } if offset <= size => offset,
            other => return Err(unexpected(&what, &other)),
        };
        let mut source =
            tokio::fs::File::from_std(file.try_clone().map_err(|e| unreadable(e.to_string()))?);
        source
            .seek(std::io::SeekFrom::Start(0))
            .await
            .map_err(|e| unreadable(e.to_string()))?;
        // What the coordinator already holds is hashed here, not sent again.
        let mut hasher = Sha256::default();
        let sink = &mut tokio::io::sink();
        match content::stream_exact(&mut source, sink, offset, Some(&mut hasher)).await {
            Streamed::Done => {}
            Streamed::Cut { cause, .. } => return Err(unreadable(cause)),
            Streamed::Write { cause, .. } => return Err(unreadable(cause.to_string())),
        }
        match content::stream_exact(&mut source, &mut stream, size - offset, Some(&mut hasher))
            .await
        {
            Streamed::Done => {}
            Streamed::Cut { cause, .. } => return Err(unreadable(cause)),
            Streamed::Write { got, cause } => {
                return Err(ContentError::Cut {
                    content: what.to_string(),
                    got: offset + got,
                    size,
                    cause: cause.to_string(),
                });
            }
        }
        let digest = Digest::from_hasher(hasher);
        protocol::write_msg(&mut stream, &Up::Sent { digest })
            .await
            .map_err(|e| ContentError::Cut {
                content: what.to_string(),
                got: size,
                size,
                cause: e.to_string(),
            })?;
        match self.answer(&what, &mut stream).await? {
            Down::Stored { digest: stored } if stored == digest => Ok(digest),
            other => Err(unexpected(&what, &other)),
        }
    }

    /// A pinned connection whose first message is `first`.
    async fn open(
        &self,
        what: &(dyn std::fmt::Display + Sync),
        first: Up,
    ) -> Result<TlsStream<TcpStream>, ContentError> {
        let cut = |cause: String| ContentError::Cut {
            content: what.to_string(),
            got: 0,
            size: 0,
            cause,
        };
        let address = self.address.current();
        let dialed = dial::dial(&address, &self.identity, &self.pinned, self.validity)
            .await
            .map_err(|e| match e.is_fatal() {
                true => ContentError::Failed {
                    content: what.to_string(),
                    reason: e.to_string(),
                },
                false => cut(e.to_string()),
            })?;
        let mut stream = dialed.stream;
        protocol::write_msg(&mut stream, &Opening::new(first))
            .await
            .map_err(|e| cut(e.to_string()))?;
        Ok(stream)
    }

    /// The coordinator's answer on a content connection; a refusal as its own error.
    async fn answer(
        &self,
        what: &(dyn std::fmt::Display + Sync),
        stream: &mut TlsStream<TcpStream>,
    ) -> Result<Down, ContentError> {
        let cut = |cause: String| ContentError::Cut {
            content: what.to_string(),
            got: 0,
            size: 0,
            cause,
        };
        match tokio::time::timeout(FIRST_ANSWER, protocol::read_msg::<_, Down>(stream)).await {
            Err(_) => Err(cut("no answer from the coordinator".into())),
            Ok(Err(e)) => Err(cut(e.to_string())),
            Ok(Ok(None)) => Err(cut("the coordinator closed the connection".into())),
            Ok(Ok(Some(Down::ContentRefused { message }))) => Err(ContentError::Failed {
                content: what.to_string(),
                reason: format!("the coordinator refused it: {message}"),
            }),
            Ok(Ok(Some(down))) => Ok(down),
        }
    }
}

/// Runs a transfer again while it fails in a way another try may mend (a cut connection).
pub async fn retrying<T, F: Future<Output = Result<T, ContentError>>>(
    what: &(dyn std::fmt::Display + Sync),
    mut once: impl FnMut() -> F,
) -> Result<T, ContentError> {
    let mut tries = 1;
    loop {
        match once().await {
            Err(e) if e.is_retryable() && tries < TRIES => {
                tracing::warn!(content = %what, tries, "{e}");
                tokio::time::sleep(Duration::from_millis(500) * tries).await;
                tries += 1;
            }
            done => return done,
        }
    }
}

fn unexpected(what: &(dyn std::fmt::Display + Sync), down: &Down) -> ContentError {
    ContentError::Failed {
        content: what.to_string(),
        reason: format!(
            "the coordinator answered {down:?}; run an agent of the coordinator's version"
        ),
    }
}
