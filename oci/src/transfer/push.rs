//! Moving an image's blobs: largest first, a few at a time, skipping what the target has, mounting
//! within one registry, one streamed PUT with a chunked fallback, transient failures retried.
use crate::local::layout::{Layout, LayoutError};
use crate::transfer::endpoint::{CopyError, Endpoint};
use crate::transfer::progress::Progress;
use crate::transfer::remote::blobs::{DEFAULT_CHUNK, Put, Started};
use crate::transfer::remote::verify::{self, ByteStream, Verdict};
use crate::transfer::remote::{self, Client, RemoteError};
use crate::types::digest::Digest;
use crate::types::spec::Descriptor;
use futures_util::StreamExt;

/// How blobs are moved.
#[derive(Debug, Clone)]
pub struct BlobOptions {
    /// Transfers at once.
    pub jobs: usize,
    /// Always upload in chunks of this many bytes instead of one PUT.
    pub chunk_size: Option<u64>,
}

/// The default number of concurrent transfers.
pub const DEFAULT_JOBS: usize = 4;

/// What happened to one blob.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Moved {
    /// The target had it already.
    Present,
    /// Mounted from another repository of the same registry.
    Mounted,
    /// Its bytes were sent.
    Uploaded,
}

/// Moves every blob the target lacks, largest first, `jobs` at a time; returns each outcome.
pub async fn move_blobs(
    src: &Endpoint,
    dst: &Endpoint,
    blobs: &[Descriptor],
    options: &BlobOptions,
    progress: &Progress,
) -> Result<Vec<(Descriptor, Moved)>, CopyError> {
    let mut order: Vec<Descriptor> = blobs.to_vec();
    // Largest first, so the long transfers overlap the short ones instead of trailing at the end.
    order.sort_by(|a, b| b.size.cmp(&a.size).then(a.digest.cmp(&b.digest)));
    // After a failure no new transfer starts, and those under way end on their own (finished, or
    // failed and their upload session cancelled) instead of being dropped mid-upload.
    let failed = std::sync::atomic::AtomicBool::new(false);
    let outcomes: Vec<Option<Result<(Descriptor, Moved), CopyError>>> =
        futures_util::stream::iter(order)
            .map(|d| {
                let failed = &failed;
                async move {
                    if failed.load(std::sync::atomic::Ordering::SeqCst) {
                        return None;
                    }
                    let moved = move_blob(src, dst, &d, options, progress).await;
                    if moved.is_err() {
                        failed.store(true, std::sync::atomic::Ordering::SeqCst);
                    }
                    Some(moved.map(|m| (d, m)))
                }
            })
            .buffer_unordered(options.jobs.max(1))
            .collect()
            .await;
    // The first failure, in the order they happened.
    outcomes.into_iter().flatten().collect()
}

async fn move_blob(
    src: &Endpoint,
    dst: &Endpoint,
    d: &Descriptor,
    options: &BlobOptions,
    progress: &Progress,
) -> Result<Moved, CopyError> {
    match dst {
        Endpoint::Registry { client, reference } => {
            if client.has_blob(&reference.repo, &d.digest).await? {
                progress.skip(d.size);
                return Ok(Moved::Present);
            }
            let mut tries = 0;
            loop {
                tries += 1;
                match upload(src, client, &reference.repo, d, options, progress).await {
                    Err(CopyError::Remote(e)) if tries < remote::MAX_TRIES && transient(&e) => {
                        tokio::time::sleep(remote::backoff(tries, None)).await;
                    }
                    other => return other,
                }
            }
        }
        Endpoint::Layout { layout, .. } => {
            if layout.has_blob(&d.digest) {
                progress.skip(d.size);
                return Ok(Moved::Present);
            }
            match src {
                Endpoint::Layout { layout: from, .. } => {
                    let (to, from, digest, size) = (layout.clone(), from.clone(), d.digest, d.size);
                    tokio::task::spawn_blocking(move || {
                        to.copy_blob_from(&from, &digest, Some(size))
                    })
                    .await
                    // Cannot fail: the task returns its errors; it panics only on a bug, which should stop the command.
                    .expect("the blob copy thread does not panic")?;
                    progress.skip(d.size);
                }
                Endpoint::Registry { .. } => {
                    let stream = open(src, d, &Verdict::default(), progress).await?;
                    write_to_layout(layout, &d.digest, stream).await?;
                }
            }
            Ok(Moved::Uploaded)
        }
    }
}

/// One try at putting a blob into a registry repository: mount, or a session with one PUT or chunks
/// (after a refused PUT, in a fresh session). A session that fails is cancelled.
async fn upload(
    src: &Endpoint,
    client: &Client,
    repo: &str,
    d: &Descriptor,
    options: &BlobOptions,
    progress: &Progress,
) -> Result<Moved, CopyError> {
    let mount_from = match src {
        Endpoint::Registry {
            client: from,
            reference,
        } if from.same_registry(client) && reference.repo != repo => Some(reference.repo.as_str()),
        _ => None,
    };
    let (location, chunk_min) = match client.start_upload(repo, &d.digest, mount_from).await? {
        Started::Mounted => {
            progress.skip(d.size);
            return Ok(Moved::Mounted);
        }
        Started::Session {
            location,
            chunk_min,
        } => (location, chunk_min),
    };
    let verdict = Verdict::default();
    let chunk = options
        .chunk_size
        .or(chunk_min.map(|m| m.max(DEFAULT_CHUNK)));
    let (mut location, chunk) = match chunk {
        Some(chunk) => (location, chunk.max(chunk_min.unwrap_or(0))),
        None => {
            let sent = async {
                let body = open(src, d, &verdict, progress).await?;
                Ok::<_, CopyError>(
                    client
                        .put_whole(repo, &location, &d.digest, d.size, body, &verdict)
                        .await?,
                )
            }
            .await;
            // A failed session is cancelled, and so is one refused as one big body.
            if !matches!(sent, Ok(Put::Done)) {
                client.cancel_upload(repo, &location).await;
            }
            if sent? == Put::Done {
                return Ok(Moved::Uploaded);
            }
            // The registry refused one big body: a fresh session, the same bytes in chunks.
            let Started::Session {
                location,
                chunk_min,
            } = client.start_upload(repo, &d.digest, None).await?
            else {
                unreachable!("an upload without mount is never answered as mounted")
            };
            (location, chunk_min.unwrap_or(0).max(DEFAULT_CHUNK))
        }
    };
    let sent = async {
        let body = open(src, d, &verdict, progress).await?;
        Ok::<_, CopyError>(
            client
                .put_chunked(repo, &mut location, &d.digest, body, chunk, &verdict)
                .await?,
        )
    }
    .await;
    if sent.is_err() {
        client.cancel_upload(repo, &location).await;
    }
    sent.map(|()| Moved::Uploaded)
}

/// Whether a failed try may succeed on its own if tried again.
fn transient(e: &RemoteError) -> bool {
    match e {
        RemoteError::Network { .. } => true,
        RemoteError::Unexpected { status, .. } => {
            remote::retryable(reqwest::StatusCode::from_u16(*status).unwrap_or_default())
        }
        _ => false,
    }
}

/// A blob's bytes from the source, verified as they stream.
async fn open(
    src: &Endpoint,
    d: &Descriptor,
    verdict: &Verdict,
    progress: &Progress,
) -> Result<ByteStream, CopyError> {
    let stream = match src {
        Endpoint::Layout { layout, .. } => {
            verify::from_layout(layout.clone(), d.digest, d.size, verdict.clone())
        }
        Endpoint::Registry { client, reference } => {
            client
                .get_blob(&reference.repo, &d.digest, d.size, verdict.clone())
                .await?
        }
    };
    Ok(progress.track(&d.digest, d.size, stream))
}

/// Writes a stream into a layout blob on a blocking thread, over a small bounded channel.
async fn write_to_layout(
    layout: &Layout,
    digest: &Digest,
    mut stream: ByteStream,
) -> Result<(), CopyError> {
    use std::io::Write;
    let (tx, mut rx) = tokio::sync::mpsc::channel::<bytes::Bytes>(4);
    let (layout, digest) = (layout.clone(), *digest);
    let writer = tokio::task::spawn_blocking(move || -> Result<(), LayoutError> {
        let mut w = layout.blob_writer()?;
        while let Some(chunk) = rx.blocking_recv() {
            w.write_all(&chunk).map_err(|source| LayoutError::Io {
                action: "write",
                path: layout.dir().to_path_buf(),
                source,
            })?;
        }
        w.commit(Some(&digest)).map(|_| ())
    });
    let mut failed = None;
    while let Some(item) = stream.next().await {
        match item {
            Ok(chunk) => {
                if tx.send(chunk).await.is_err() {
                    break;
                }
            }
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    drop(tx);
    if let Some(e) = failed {
        // The writer sees the channel close, refuses the short blob and removes its temporary file.
        let _ = writer.await;
        return Err(match e.kind() {
            std::io::ErrorKind::InvalidData => {
                CopyError::Remote(RemoteError::Mismatch(e.to_string()))
            }
            _ => CopyError::Remote(RemoteError::Network {
                host: "the source".into(),
                detail: e.to_string(),
            }),
        });
    }
    writer
        .await
        // Cannot fail: the task returns its errors; it panics only on a bug, which should stop the command.
        .expect("the blob writer thread does not panic")?;
    Ok(())
}
