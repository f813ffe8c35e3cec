//! Byte streams checked against their digest as they flow, so no unverified byte is taken for a good one.
use crate::types::digest::{Digest, Hasher, mismatch_message};
use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use std::io;
use std::sync::{Arc, Mutex};

/// A boxed stream of blob bytes.
pub type ByteStream = futures_util::stream::BoxStream<'static, io::Result<Bytes>>;

/// Where a verifying stream leaves its complaint, so it survives being wrapped in an HTTP error.
#[derive(Clone, Default)]
pub struct Verdict(Arc<Mutex<Option<String>>>);

impl Verdict {
    /// The mismatch message, if the bytes were bad.
    pub fn mismatch(&self) -> Option<String> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    fn set(&self, message: String) -> io::Error {
        *self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(message.clone());
        io::Error::new(io::ErrorKind::InvalidData, message)
    }
}

/// Wraps a stream so that it yields an `InvalidData` error instead of its end when its bytes do
/// not hash to `digest` or are not `size` long.
pub fn verified<S, E>(inner: S, digest: Digest, size: u64, verdict: Verdict) -> ByteStream
where
    S: Stream<Item = Result<Bytes, E>> + Send + 'static,
    E: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let state = (Box::pin(inner), Hasher::new(), false);
    futures_util::stream::unfold(state, move |(mut inner, mut hasher, done)| {
        let verdict = verdict.clone();
        async move {
            if done {
                return None;
            }
            match inner.next().await {
                Some(Ok(chunk)) => {
                    hasher.update(&chunk);
                    if hasher.len() > size {
                        let e = verdict.set(format!(
                            "blob {digest} is longer than its recorded size of {size} bytes"
                        ));
                        return Some((Err(e), (inner, hasher, true)));
                    }
                    Some((Ok(chunk), (inner, hasher, false)))
                }
                Some(Err(e)) => Some((Err(io::Error::other(e)), (inner, hasher, true))),
                None => {
                    let (actual, len) = hasher.clone().finish();
                    if actual != digest || len != size {
                        let e = verdict.set(mismatch_message("blob", &digest, &actual, len));
                        return Some((Err(e), (inner, hasher, true)));
                    }
                    None
                }
            }
        }
    })
    .boxed()
}

/// Streams a blob of a layout: a blocking thread reads it through the layout's verifying reader and
/// hands chunks over a small bounded channel, so memory stays flat with blob size.
pub fn from_layout(
    layout: crate::local::layout::Layout,
    digest: Digest,
    size: u64,
    verdict: Verdict,
) -> ByteStream {
    const CHUNK: usize = 256 << 10;
    let (tx, rx) = tokio::sync::mpsc::channel::<io::Result<Bytes>>(4);
    tokio::task::spawn_blocking(move || {
        use std::io::Read;
        let mut reader = match layout.open_blob(&digest, Some(size)) {
            Ok(r) => r,
            Err(e) => {
                let _ = tx.blocking_send(Err(io::Error::other(e.to_string())));
                return;
            }
        };
        loop {
            let mut buf = vec![0u8; CHUNK];
            match reader.read(&mut buf) {
                Ok(0) => return,
                Ok(n) => {
                    buf.truncate(n);
                    if tx.blocking_send(Ok(Bytes::from(buf))).is_err() {
                        return;
                    }
                }
                Err(e) => {
                    let e = if e.kind() == io::ErrorKind::InvalidData {
                        verdict.set(e.to_string())
                    } else {
                        e
                    };
                    let _ = tx.blocking_send(Err(e));
                    return;
                }
            }
        }
    });
    futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    })
    .boxed()
}
