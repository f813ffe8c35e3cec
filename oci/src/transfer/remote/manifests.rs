//! Manifest operations: HEAD, GET (checked against the digest asked for) and PUT of the exact stored bytes.
use super::{Client, RemoteError, Scope, error_detail};
use crate::types::digest::Digest;
use crate::types::spec;
use reqwest::{Method, StatusCode, header};

/// The media types asked for and accepted: OCI and Docker schema 2, manifests and indexes.
pub const ACCEPT: [&str; 4] = [
    spec::MEDIA_TYPE_MANIFEST,
    spec::MEDIA_TYPE_INDEX,
    spec::MEDIA_TYPE_DOCKER_MANIFEST,
    spec::MEDIA_TYPE_DOCKER_LIST,
];

/// The most bytes read for one manifest.
const MANIFEST_LIMIT: usize = 4 << 20;

/// A manifest or index as the registry stores it.
#[derive(Debug, Clone)]
pub struct Manifest {
    pub bytes: Vec<u8>,
    pub media_type: String,
    pub digest: Digest,
}

impl Client {
    /// The digest the repository has under `reference` (tag or digest), or None.
    pub async fn head_manifest(
        &self,
        repo: &str,
        reference: &str,
        push: bool,
    ) -> Result<Option<Digest>, RemoteError> {
        let scope = if push {
            Scope::push(repo)
        } else {
            Scope::pull(repo)
        };
        let url = self.url(&format!("/v2/{repo}/manifests/{reference}"));
        let resp = self
            .send(&scope, Method::HEAD, &url, |rb| {
                rb.header(header::ACCEPT, ACCEPT.join(", "))
            })
            .await?;
        match resp.status() {
            s if s.is_success() => Ok(resp
                .headers()
                .get("docker-content-digest")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse().ok())),
            StatusCode::NOT_FOUND => Ok(None),
            _ => Err(self
                .status_error(
                    resp,
                    &scope,
                    &format!("docker://{}/{repo}:{reference}", self.host()),
                )
                .await),
        }
    }

    /// Fetches a manifest; with a digest reference its bytes must hash to it.
    pub async fn get_manifest(&self, repo: &str, reference: &str) -> Result<Manifest, RemoteError> {
        self.fetch_manifest(repo, reference, false)
            .await?
            .ok_or_else(|| RemoteError::NotFound {
                what: self.manifest_name(repo, reference),
            })
    }

    /// Fetches a manifest that may not be there (a referrer's tag): None on 404.
    pub async fn get_manifest_if_any(
        &self,
        repo: &str,
        reference: &str,
    ) -> Result<Option<Manifest>, RemoteError> {
        self.fetch_manifest(repo, reference, true).await
    }

    fn manifest_name(&self, repo: &str, reference: &str) -> String {
        let at = if reference.starts_with("sha256:") {
            "@"
        } else {
            ":"
        };
        format!("docker://{}/{repo}{at}{reference}", self.host())
    }

    async fn fetch_manifest(
        &self,
        repo: &str,
        reference: &str,
        absent_is_none: bool,
    ) -> Result<Option<Manifest>, RemoteError> {
        let scope = Scope::pull(repo);
        let name = self.manifest_name(repo, reference);
        let url = self.url(&format!("/v2/{repo}/manifests/{reference}"));
        let resp = self
            .send(&scope, Method::GET, &url, |rb| {
                rb.header(header::ACCEPT, ACCEPT.join(", "))
            })
            .await?;
        if absent_is_none && resp.status() == StatusCode::NOT_FOUND {
            return Ok(None);
        }
        if !resp.status().is_success() {
            return Err(self.status_error(resp, &scope, &name).await);
        }
        let media_type = resp
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(|v| v.split(';').next().unwrap_or(v).trim().to_string())
            .unwrap_or_default();
        let bad = |detail: String| RemoteError::BadAnswer {
            host: self.host().to_string(),
            method: "GET".into(),
            path: format!("/v2/{repo}/manifests/{reference}"),
            detail,
        };
        let bytes = resp.bytes().await.map_err(|e| bad(e.to_string()))?.to_vec();
        if bytes.len() > MANIFEST_LIMIT {
            return Err(bad(format!("the manifest is over {MANIFEST_LIMIT} bytes")));
        }
        // Some registries label a manifest loosely; the document's own mediaType is the truth.
        let media_type = crate::local::layout::sniff_media_type(&bytes).unwrap_or(media_type);
        if !ACCEPT.contains(&media_type.as_str()) {
            return Err(RemoteError::MediaTypeUnknown {
                what: name,
                media_type,
            });
        }
        let digest = Digest::of(&bytes);
        if let Ok(asked) = reference.parse::<Digest>()
            && asked != digest
        {
            let m = crate::types::digest::mismatch_message(
                "manifest",
                &asked,
                &digest,
                bytes.len() as u64,
            );
            return Err(RemoteError::Mismatch(m));
        }
        Ok(Some(Manifest {
            bytes,
            media_type,
            digest,
        }))
    }

    /// The OCI 1.1 referrers API's index of what refers to `digest`, or None when the registry
    /// does not offer the API (any answer but 200 with an index: distribution 2.8 says 404).
    pub async fn get_referrers(
        &self,
        repo: &str,
        digest: &Digest,
    ) -> Result<Option<spec::Index>, RemoteError> {
        let scope = Scope::pull(repo);
        let url = self.url(&format!("/v2/{repo}/referrers/{digest}"));
        let resp = self
            .send(&scope, Method::GET, &url, |rb| {
                rb.header(header::ACCEPT, spec::MEDIA_TYPE_INDEX)
            })
            .await?;
        if resp.status() != StatusCode::OK {
            return Ok(None);
        }
        let bytes = resp.bytes().await.map_err(|e| RemoteError::BadAnswer {
            host: self.host().to_string(),
            method: "GET".into(),
            path: format!("/v2/{repo}/referrers/{digest}"),
            detail: e.to_string(),
        })?;
        if bytes.len() > MANIFEST_LIMIT {
            return Err(RemoteError::BadAnswer {
                host: self.host().to_string(),
                method: "GET".into(),
                path: format!("/v2/{repo}/referrers/{digest}"),
                detail: format!("the referrers index is over {MANIFEST_LIMIT} bytes"),
            });
        }
        // A 200 that is not an index is a registry that routes the path elsewhere: no API.
        Ok(serde_json::from_slice(&bytes).ok())
    }

    /// Puts a manifest's exact bytes under `reference` (a tag, or its digest).
    pub async fn put_manifest(
        &self,
        repo: &str,
        reference: &str,
        manifest: &Manifest,
    ) -> Result<(), RemoteError> {
        let scope = Scope::push(repo);
        let url = self.url(&format!("/v2/{repo}/manifests/{reference}"));
        let body = bytes::Bytes::from(manifest.bytes.clone());
        let resp = self
            .send(&scope, Method::PUT, &url, |rb| {
                rb.header(header::CONTENT_TYPE, &manifest.media_type)
                    .body(body.clone())
            })
            .await?;
        let status = resp.status();
        if status.is_success() {
            return Ok(());
        }
        if status == StatusCode::UNSUPPORTED_MEDIA_TYPE {
            return Err(RemoteError::MediaTypeRefused {
                host: self.host().to_string(),
                media_type: manifest.media_type.clone(),
                status: status.as_u16(),
            });
        }
        if status == StatusCode::BAD_REQUEST {
            let detail = error_detail(resp).await;
            if detail.contains("MANIFEST_INVALID") && detail.to_lowercase().contains("media") {
                return Err(RemoteError::MediaTypeRefused {
                    host: self.host().to_string(),
                    media_type: manifest.media_type.clone(),
                    status: status.as_u16(),
                });
            }
            return Err(RemoteError::Unexpected {
                host: self.host().to_string(),
                status: status.as_u16(),
                path: format!("/v2/{repo}/manifests/{reference}"),
                detail,
            });
        }
        Err(self
            .status_error(
                resp,
                &scope,
                &format!("docker://{}/{repo}:{reference}", self.host()),
            )
            .await)
    }
}
