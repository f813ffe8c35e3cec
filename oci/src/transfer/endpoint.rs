//! One side of a transfer, opened (a layout or a registry), what a transfer fails with, and
//! the blobs an image manifest names.
use crate::local::layout::{Layout, LayoutError, RefOrDigest, Rollback};
use crate::transfer::auth;
use crate::transfer::reference::{ImageRef, RegistryRef};
use crate::transfer::remote::manifests::Manifest;
use crate::transfer::remote::{Client, RemoteError};
use crate::transfer::tls::TlsOptions;
use crate::types::digest::Digest;
use crate::types::spec::Descriptor;

#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    #[error(transparent)]
    Remote(#[from] RemoteError),
    #[error(transparent)]
    Layout(#[from] LayoutError),
    #[error(
        "no manifest of {image} is for {wanted}: it has {available}; pass one of those to --platform"
    )]
    NoPlatform {
        image: String,
        wanted: String,
        available: String,
    },
    #[error("{image} is not a valid {what}: {detail}")]
    BadManifest {
        image: String,
        what: &'static str,
        detail: String,
    },
    #[error(
        "the destination pins digest {pinned} but the image is {actual}: drop @DIGEST from the destination or copy that image"
    )]
    PinMismatch { pinned: Digest, actual: Digest },
    #[error(
        "{image} has more than {limit} referrers: pass --artifact-type to take only one kind, or --no-referrers"
    )]
    TooManyReferrers { image: String, limit: usize },
    #[error(
        "after the copy, {target} lacks these referrers of the source: {missing}; copy again, and check that nothing at the target deletes them"
    )]
    ReferrersMissing { target: String, missing: String },
    #[error(
        "{target} holds a manifest under the referrers fallback tag {tag} that is not an index: remove that tag, or copy with --no-referrers"
    )]
    FallbackNotIndex { target: String, tag: String },
    #[error(
        "{target}: the referrers fallback tag {tag} was replaced by another writer {tries} times in a row; copy again"
    )]
    FallbackContended {
        target: String,
        tag: String,
        tries: usize,
    },
    #[error("cannot read {}: {detail}", .path.display())]
    Input {
        path: std::path::PathBuf,
        detail: String,
    },
    #[error("a worker thread failed: {0}")]
    Task(String),
}

/// One side of a transfer, opened.
pub enum Endpoint {
    Layout {
        layout: Layout,
        image: RefOrDigest,
        name: String,
        /// A destination's writer lock, and the layout taken back if the copy fails after making it.
        writing: Option<Rollback>,
    },
    Registry {
        client: Client,
        reference: RegistryRef,
    },
}

impl Endpoint {
    /// Opens a reference as a source (the layout must exist) or a destination (it is created).
    pub fn open(
        image: &ImageRef,
        tls: &TlsOptions,
        creds: Option<&str>,
        destination: bool,
    ) -> Result<Endpoint, CopyError> {
        Ok(match image {
            ImageRef::Layout(l) => {
                let (layout, writing) = if destination {
                    let (layout, rollback) = Layout::create_locked(&l.dir)?;
                    (layout, Some(rollback))
                } else {
                    (Layout::open(&l.dir)?, None)
                };
                Endpoint::Layout {
                    layout,
                    image: l.image.clone(),
                    name: image.to_string(),
                    writing,
                }
            }
            ImageRef::Registry(r) => {
                let credential = auth::find(&r.host, creds).map_err(RemoteError::from)?;
                let client = Client::new(&r.host, tls, credential)?;
                Endpoint::Registry {
                    client,
                    reference: r.clone(),
                }
            }
        })
    }

    /// The transfer succeeded: a destination layout keeps what it got (and lets go of its lock).
    pub fn finish(self) {
        if let Endpoint::Layout {
            writing: Some(rollback),
            ..
        } = self
        {
            rollback.keep();
        }
    }

    /// How the image is named in messages.
    pub fn name(&self) -> String {
        match self {
            Endpoint::Layout { name, .. } => name.clone(),
            Endpoint::Registry { reference, .. } => reference.to_string(),
        }
    }

    /// The named manifest or index, its bytes checked against its digest.
    pub async fn top_manifest(&self) -> Result<Manifest, CopyError> {
        match self {
            Endpoint::Layout { layout, image, .. } => {
                let d = layout.resolve(image)?;
                let bytes = layout.read_blob(&d.digest, Some(d.size))?;
                Ok(Manifest {
                    bytes,
                    media_type: d.media_type,
                    digest: d.digest,
                })
            }
            Endpoint::Registry { client, reference } => Ok(client
                .get_manifest(&reference.repo, &reference.reference())
                .await?),
        }
    }

    pub(crate) async fn manifest(&self, d: &Descriptor) -> Result<Manifest, CopyError> {
        match self {
            Endpoint::Layout { layout, .. } => {
                let bytes = layout.read_blob(&d.digest, Some(d.size))?;
                Ok(Manifest {
                    bytes,
                    media_type: d.media_type.clone(),
                    digest: d.digest,
                })
            }
            Endpoint::Registry { client, reference } => Ok(client
                .get_manifest(&reference.repo, &d.digest.to_string())
                .await?),
        }
    }
}

pub(crate) fn parse<T: serde::de::DeserializeOwned>(
    image: &str,
    what: &'static str,
    bytes: &[u8],
) -> Result<T, CopyError> {
    serde_json::from_slice(bytes).map_err(|e| CopyError::BadManifest {
        image: image.to_string(),
        what,
        detail: e.to_string(),
    })
}

/// The config and layers an image manifest points at.
pub fn manifest_blobs(
    image: &str,
    bytes: &[u8],
) -> Result<(Descriptor, Vec<Descriptor>), CopyError> {
    #[derive(serde::Deserialize)]
    struct ImageManifest {
        config: Descriptor,
        #[serde(default)]
        layers: Vec<Descriptor>,
    }
    let m: ImageManifest = parse(image, "manifest", bytes)?;
    Ok((m.config, m.layers))
}
