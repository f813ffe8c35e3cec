//! Blob operations: HEAD, streamed GET, cross-repository mount, and uploads (one streamed PUT, or chunks).
use super::verify::{ByteStream, Verdict};
use super::{Client, RemoteError, Scope, error_detail};
use crate::types::digest::Digest;
use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use reqwest::{Method, Response, StatusCode, header};

/// Chunks are this large unless the registry asks for more with `OCI-Chunk-Min-Length`.
pub const DEFAULT_CHUNK: u64 = 8 << 20;

/// An upload session, or a mount that already made the blob appear.
pub enum Started {
    Mounted,
    Session {
        location: String,
        chunk_min: Option<u64>,
    },
}

/// How a monolithic PUT ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Put {
    Done,
    /// The registry refused one big body (413, or a 400 that is not about the digest): use chunks.
    WantsChunks,
}

impl Client {
    /// Whether the repository has the blob (one HEAD).
    pub async fn has_blob(&self, repo: &str, digest: &Digest) -> Result<bool, RemoteError> {
        let scope = Scope::push(repo);
        let url = self.url(&format!("/v2/{repo}/blobs/{digest}"));
        let resp = self.send(&scope, Method::HEAD, &url, |rb| rb).await?;
        match resp.status() {
            s if s.is_success() => Ok(true),
            StatusCode::NOT_FOUND => Ok(false),
            _ => Err(self
                .status_error(resp, &scope, &format!("blob {digest}"))
                .await),
        }
    }

    /// Streams a blob, verified against its digest and size; `verdict` records a mismatch.
    pub async fn get_blob(
        &self,
        repo: &str,
        digest: &Digest,
        size: u64,
        verdict: Verdict,
    ) -> Result<ByteStream, RemoteError> {
        let scope = Scope::pull(repo);
        let url = self.url(&format!("/v2/{repo}/blobs/{digest}"));
        let resp = self.send(&scope, Method::GET, &url, |rb| rb).await?;
        if !resp.status().is_success() {
            let what = format!("blob {digest} in docker://{}/{repo}", self.host());
            return Err(self.status_error(resp, &scope, &what).await);
        }
        Ok(super::verify::verified(
            resp.bytes_stream(),
            *digest,
            size,
            verdict,
        ))
    }

    /// Reads a small blob (an image config) whole, verified, refusing one over the JSON limit.
    pub async fn read_blob(
        &self,
        repo: &str,
        digest: &Digest,
        size: u64,
    ) -> Result<Vec<u8>, RemoteError> {
        if size > crate::local::layout::JSON_LIMIT {
            return Err(RemoteError::BadAnswer {
                host: self.host().to_string(),
                method: "GET".into(),
                path: format!("/v2/{repo}/blobs/{digest}"),
                detail: format!(
                    "the document is {size} bytes, over {} allowed",
                    crate::local::layout::JSON_LIMIT
                ),
            });
        }
        let verdict = Verdict::default();
        let mut stream = self.get_blob(repo, digest, size, verdict.clone()).await?;
        let mut bytes = Vec::with_capacity(size as usize);
        while let Some(chunk) = stream.next().await {
            match chunk {
                Ok(c) => bytes.extend_from_slice(&c),
                Err(e) => {
                    return Err(match verdict.mismatch() {
                        Some(m) => RemoteError::Mismatch(m),
                        None => RemoteError::Network {
                            host: self.host().to_string(),
                            detail: e.to_string(),
                        },
                    });
                }
            }
        }
        Ok(bytes)
    }

    /// Opens an upload session, first trying to mount the blob from `mount_from` on this registry.
    pub async fn start_upload(
        &self,
        repo: &str,
        digest: &Digest,
        mount_from: Option<&str>,
    ) -> Result<Started, RemoteError> {
        let scope = Scope {
            repo: repo.to_string(),
            push: true,
            mount_from: mount_from.map(str::to_string),
        };
        let mut path = format!("/v2/{repo}/blobs/uploads/");
        if let Some(from) = mount_from {
            path += &format!("?mount={digest}&from={from}");
        }
        let url = self.url(&path);
        let resp = self
            .send(&scope, Method::POST, &url, |rb| {
                rb.header(header::CONTENT_LENGTH, "0")
            })
            .await?;
        match resp.status() {
            StatusCode::CREATED if mount_from.is_some() => Ok(Started::Mounted),
            StatusCode::ACCEPTED => {
                let location = location(self, &resp, "POST", &path)?;
                let chunk_min = resp
                    .headers()
                    .get("oci-chunk-min-length")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.trim().parse().ok());
                Ok(Started::Session {
                    location,
                    chunk_min,
                })
            }
            _ => Err(self
                .status_error(
                    resp,
                    &scope,
                    &format!("repository docker://{}/{repo}", self.host()),
                )
                .await),
        }
    }

    /// Uploads the whole blob as one streamed PUT to the session.
    pub async fn put_whole(
        &self,
        repo: &str,
        location: &str,
        digest: &Digest,
        size: u64,
        body: ByteStream,
        verdict: &Verdict,
    ) -> Result<Put, RemoteError> {
        let scope = Scope::push(repo);
        let url = with_digest(&self.url(location), digest);
        let rb = self
            .request(Method::PUT, &url)
            .header(header::CONTENT_TYPE, "application/octet-stream")
            .header(header::CONTENT_LENGTH, size)
            .body(reqwest::Body::wrap_stream(body));
        let resp = self.send_once(&scope, rb).await;
        if let Some(m) = verdict.mismatch() {
            return Err(RemoteError::Mismatch(m));
        }
        let resp = resp?;
        match resp.status() {
            StatusCode::CREATED | StatusCode::NO_CONTENT | StatusCode::OK => Ok(Put::Done),
            StatusCode::PAYLOAD_TOO_LARGE => Ok(Put::WantsChunks),
            StatusCode::BAD_REQUEST => {
                let detail = error_detail(resp).await;
                if detail.contains("DIGEST_INVALID") || detail.contains("SIZE_INVALID") {
                    Err(RemoteError::Unexpected {
                        host: self.host().to_string(),
                        status: 400,
                        path: format!("/v2/{repo}/blobs/uploads/"),
                        detail,
                    })
                } else {
                    Ok(Put::WantsChunks)
                }
            }
            _ => Err(self
                .status_error(resp, &scope, &format!("upload of blob {digest}"))
                .await),
        }
    }

    /// Cancels an upload session that failed (`DELETE`), so the registry does not keep its partial
    /// data until its own purge. Best effort: the transfer is already failing with its own error.
    pub async fn cancel_upload(&self, repo: &str, location: &str) {
        let url = self.url(location);
        let _ = self
            .send(&Scope::push(repo), Method::DELETE, &url, |rb| rb)
            .await;
    }

    /// Uploads the blob in PATCH chunks of `chunk` bytes (at least what the registry asked for),
    /// then closes the session with a PUT carrying the digest. One chunk is held in memory at a
    /// time. `location` follows the session (for a cancel if it fails).
    pub async fn put_chunked(
        &self,
        repo: &str,
        location: &mut String,
        digest: &Digest,
        mut body: ByteStream,
        chunk: u64,
        verdict: &Verdict,
    ) -> Result<(), RemoteError> {
        let scope = Scope::push(repo);
        let chunk = chunk.max(1) as usize;
        let mut offset = 0u64;
        let mut buf = BytesMut::with_capacity(chunk);
        let mut ended = false;
        while !ended {
            while buf.len() < chunk {
                match body.next().await {
                    Some(Ok(b)) => buf.extend_from_slice(&b),
                    Some(Err(e)) => {
                        return Err(match verdict.mismatch() {
                            Some(m) => RemoteError::Mismatch(m),
                            None => RemoteError::Network {
                                host: self.host().to_string(),
                                detail: e.to_string(),
                            },
                        });
                    }
                    None => {
                        ended = true;
                        break;
                    }
                }
            }
            let take = buf.len().min(chunk);
            if take == 0 {
                break;
            }
            let piece: Bytes = buf.split_to(take).freeze();
            let end = offset + piece.len() as u64 - 1;
            let url = self.url(location);
            let resp = self
                .send(&scope, Method::PATCH, &url, |rb| {
                    rb.header(header::CONTENT_TYPE, "application/octet-stream")
                        .header(header::CONTENT_RANGE, format!("{offset}-{end}"))
                        .header(header::CONTENT_LENGTH, piece.len())
                        .body(piece.clone())
                })
                .await?;
            if resp.status() != StatusCode::ACCEPTED {
                return Err(self
                    .status_error(resp, &scope, &format!("upload of blob {digest}"))
                    .await);
            }
            *location = self::location(self, &resp, "PATCH", &url)?;
            offset = end + 1;
        }
        let url = with_digest(&self.url(location), digest);
        let resp = self
            .send(&scope, Method::PUT, &url, |rb| {
                rb.header(header::CONTENT_LENGTH, "0")
            })
            .await?;
        match resp.status() {
            StatusCode::CREATED | StatusCode::NO_CONTENT | StatusCode::OK => Ok(()),
            _ => Err(self
                .status_error(resp, &scope, &format!("upload of blob {digest}"))
                .await),
        }
    }
}

fn location(
    client: &Client,
    resp: &Response,
    method: &str,
    path: &str,
) -> Result<String, RemoteError> {
    resp.headers()
        .get(header::LOCATION)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .ok_or_else(|| RemoteError::BadAnswer {
            host: client.host().to_string(),
            method: method.to_string(),
            path: path.split('?').next().unwrap_or(path).to_string(),
            detail: "no Location header for the upload".into(),
        })
}

/// The upload URL with `digest=` added to whatever query the registry put there.
fn with_digest(url: &str, digest: &Digest) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}digest={digest}")
}
