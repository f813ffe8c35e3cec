//! Copying an image by digest between layouts and registries: read the manifest (or index and its
//! manifests), plan the blobs, move them, then put the manifests, the named one last.
use crate::local::inspect::{self, Inspection};
use crate::local::layout::{LayoutError, RefOrDigest};
use crate::transfer::carry::{self, Carried};
use crate::transfer::endpoint::{CopyError, Endpoint, manifest_blobs, parse};
use crate::transfer::progress::Progress;
use crate::transfer::push::{self, BlobOptions, Moved};
use crate::transfer::reference::RegistryRef;
use crate::transfer::remote::manifests::Manifest;
use crate::transfer::remote::{Client, RemoteError};
use crate::types::digest::Digest;
use crate::types::spec::{self, Descriptor, Index, Platform};
use std::collections::BTreeMap;

/// What to copy and how.
#[derive(Debug, Clone)]
pub struct CopyOptions {
    pub blobs: BlobOptions,
    /// Keep only these platforms of an index (an empty list keeps the index whole).
    pub platforms: Vec<Platform>,
    /// Never draw progress bars.
    pub quiet: bool,
    /// Carry what refers to the image (signatures, SBOMs, attestations).
    pub referrers: bool,
    /// Carry only referrers of this artifact type.
    pub artifact_type: Option<String>,
}

/// What a copy did, for the one-line answer and `--json`.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    pub reference: String,
    pub digest: Digest,
    pub media_type: String,
    pub size: u64,
    /// The target had this manifest under this reference already: nothing was sent.
    pub already_present: bool,
    pub blobs: usize,
    pub blobs_uploaded: usize,
    pub blobs_mounted: usize,
    pub blobs_present: usize,
    pub bytes_uploaded: u64,
    pub manifests_pushed: usize,
    /// What refers to the image, carried along (absent with `--no-referrers`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub referrers: Option<Carried>,
}

/// The manifests and blobs of one image, in the order they must be put.
struct Plan {
    /// Child manifests of an index (put by digest, before the top one).
    children: Vec<Manifest>,
    top: Manifest,
    blobs: Vec<Descriptor>,
    /// The top index was rewritten to list only the asked platforms.
    filtered: bool,
}

/// Copies `src` to `dst`: blobs first, then child manifests, then the named manifest, so a tag
/// never points at a half-copied image.
pub async fn copy(
    src: &Endpoint,
    dst: &Endpoint,
    options: &CopyOptions,
) -> Result<Report, CopyError> {
    let plan = plan(src, options).await?;
    let mut report = copy_image(src, dst, &plan, options).await?;
    if options.referrers {
        // A filtered index is a new document nothing refers to; its platforms' manifests are not.
        let mut roots: Vec<Digest> = plan.children.iter().map(|c| c.digest).collect();
        if !plan.filtered {
            roots.insert(0, plan.top.digest);
        }
        let carried = carry::carry(
            src,
            dst,
            &roots,
            options.artifact_type.as_deref(),
            &options.blobs,
            options.quiet,
        )
        .await?;
        report.referrers = Some(carried);
    }
    Ok(report)
}

/// The image itself: blobs, child manifests, then the named manifest.
async fn copy_image(
    src: &Endpoint,
    dst: &Endpoint,
    plan: &Plan,
    options: &CopyOptions,
) -> Result<Report, CopyError> {
    let top = &plan.top;
    let mut report = Report {
        reference: dst.name(),
        digest: top.digest,
        media_type: top.media_type.clone(),
        size: top.bytes.len() as u64,
        already_present: false,
        blobs: plan.blobs.len(),
        blobs_uploaded: 0,
        blobs_mounted: 0,
        blobs_present: 0,
        bytes_uploaded: 0,
        manifests_pushed: 0,
        referrers: None,
    };
    if let Endpoint::Registry { reference, .. } = dst
        && let Some(pinned) = reference.digest
        && pinned != top.digest
    {
        return Err(CopyError::PinMismatch {
            pinned,
            actual: top.digest,
        });
    }
    if target_has(dst, top).await? {
        report.already_present = true;
        report.blobs_present = plan.blobs.len();
        return Ok(report);
    }
    let total: u64 = plan.blobs.iter().map(|b| b.size).sum();
    let progress = Progress::new(total, options.quiet);
    let moved = push::move_blobs(src, dst, &plan.blobs, &options.blobs, &progress).await;
    progress.finish();
    for (d, m) in moved? {
        match m {
            Moved::Present => report.blobs_present += 1,
            Moved::Mounted => report.blobs_mounted += 1,
            Moved::Uploaded => {
                report.blobs_uploaded += 1;
                report.bytes_uploaded += d.size;
            }
        }
    }
    for child in &plan.children {
        report.manifests_pushed += put_manifest(dst, child, false).await? as usize;
    }
    report.manifests_pushed += put_manifest(dst, top, true).await? as usize;
    Ok(report)
}

/// Reads the image from the source and lists what must move.
async fn plan(src: &Endpoint, options: &CopyOptions) -> Result<Plan, CopyError> {
    let mut top = src.top_manifest().await?;
    let mut children = Vec::new();
    let mut blobs = BTreeMap::new();
    let mut filtered = false;
    if spec::is_index(&top.media_type) {
        let index: Index = parse(&src.name(), "index", &top.bytes)?;
        let kept = select_platforms(&src.name(), &index, &options.platforms)?;
        if kept.len() != index.manifests.len() {
            filtered = true;
            // A filtered index is a new document listing only what is copied, never a sparse one.
            let filtered = Index {
                manifests: kept.clone(),
                ..index
            };
            top = Manifest {
                bytes: spec::to_json_bytes(&filtered),
                media_type: top.media_type,
                digest: Digest::of(&spec::to_json_bytes(&filtered)),
            };
        }
        for d in &kept {
            let child = src.manifest(d).await?;
            if !spec::is_manifest(&child.media_type) {
                return Err(CopyError::BadManifest {
                    image: src.name(),
                    what: "index",
                    detail: format!(
                        "it lists {} of media type {}, which is not an image manifest",
                        d.digest, child.media_type
                    ),
                });
            }
            image_blobs(&src.name(), &child.bytes, &mut blobs)?;
            children.push(child);
        }
    } else if spec::is_manifest(&top.media_type) {
        image_blobs(&src.name(), &top.bytes, &mut blobs)?;
    } else {
        return Err(RemoteError::MediaTypeUnknown {
            what: src.name(),
            media_type: top.media_type,
        }
        .into());
    }
    Ok(Plan {
        children,
        top,
        blobs: blobs.into_values().collect(),
        filtered,
    })
}

/// The config and layers of an image manifest, added to `into` by digest (shared blobs once).
fn image_blobs(
    image: &str,
    bytes: &[u8],
    into: &mut BTreeMap<Digest, Descriptor>,
) -> Result<(), CopyError> {
    let (config, layers) = manifest_blobs(image, bytes)?;
    for d in std::iter::once(config).chain(layers) {
        into.entry(d.digest).or_insert(d);
    }
    Ok(())
}

/// What `oci inspect` shows of an image in a registry (the same summary as for a layout), and the
/// manifest's exact bytes.
pub async fn inspect_registry(
    client: &Client,
    r: &RegistryRef,
) -> Result<(Inspection, Vec<u8>), CopyError> {
    let m = client.get_manifest(&r.repo, &r.reference()).await?;
    let descriptor = Descriptor::new(&m.media_type, m.digest, m.bytes.len() as u64);
    if spec::is_index(&m.media_type) {
        let index: Index = parse(&r.to_string(), "index", &m.bytes)?;
        return Ok((
            Inspection::Index(inspect::summarize_index(&descriptor, &index)),
            m.bytes,
        ));
    }
    let (config, layers) = manifest_blobs(&r.to_string(), &m.bytes)?;
    let config_bytes = client
        .read_blob(&r.repo, &config.digest, config.size)
        .await?;
    let config_json: serde_json::Value = parse(&r.to_string(), "image config", &config_bytes)?;
    let summary = inspect::summarize_manifest(&descriptor, &config, &layers, &config_json);
    Ok((Inspection::Manifest(Box::new(summary)), m.bytes))
}

/// The index entries for the wanted platforms (all of them when none is asked for).
fn select_platforms(
    image: &str,
    index: &Index,
    wanted: &[Platform],
) -> Result<Vec<Descriptor>, CopyError> {
    if wanted.is_empty() {
        return Ok(index.manifests.clone());
    }
    let matches = |d: &Descriptor, w: &Platform| {
        d.platform.as_ref().is_some_and(|p| {
            p.os == w.os
                && p.architecture == w.architecture
                && (w.variant.is_none() || p.variant == w.variant)
        })
    };
    for w in wanted {
        if !index.manifests.iter().any(|d| matches(d, w)) {
            let available: Vec<String> = index
                .manifests
                .iter()
                .filter_map(|d| d.platform.as_ref().map(|p| p.to_string()))
                .collect();
            return Err(CopyError::NoPlatform {
                image: image.to_string(),
                wanted: w.to_string(),
                available: if available.is_empty() {
                    "no platforms".into()
                } else {
                    available.join(", ")
                },
            });
        }
    }
    Ok(index
        .manifests
        .iter()
        .filter(|d| wanted.iter().any(|w| matches(d, w)))
        .cloned()
        .collect())
}

/// Whether the destination already has exactly this manifest under its reference.
async fn target_has(dst: &Endpoint, top: &Manifest) -> Result<bool, CopyError> {
    match dst {
        Endpoint::Registry { client, reference } => Ok(client
            .head_manifest(&reference.repo, &reference.reference(), true)
            .await?
            == Some(top.digest)),
        Endpoint::Layout { layout, image, .. } => Ok(match image {
            RefOrDigest::Name(_) => layout
                .resolve(image)
                .ok()
                .is_some_and(|d| d.digest == top.digest),
            RefOrDigest::Digest(d) => *d == top.digest && layout.has_blob(d),
        }),
    }
}

/// Puts one manifest's exact bytes: a child by digest, the top one under the destination's
/// reference. Returns whether anything was written.
async fn put_manifest(dst: &Endpoint, m: &Manifest, named: bool) -> Result<bool, CopyError> {
    match dst {
        Endpoint::Registry { client, reference } => {
            let target = if named {
                reference.reference()
            } else {
                m.digest.to_string()
            };
            if !named
                && client
                    .head_manifest(&reference.repo, &target, true)
                    .await?
                    .is_some()
            {
                return Ok(false);
            }
            client.put_manifest(&reference.repo, &target, m).await?;
            Ok(true)
        }
        Endpoint::Layout { layout, image, .. } => {
            let (layout, m, image) = (layout.clone(), m.clone(), image.clone());
            tokio::task::spawn_blocking(move || -> Result<bool, LayoutError> {
                layout.write_blob(&m.bytes)?;
                // The destination's writer lock is held for the whole copy.
                if named && let RefOrDigest::Name(name) = &image {
                    let d = Descriptor::new(&m.media_type, m.digest, m.bytes.len() as u64);
                    layout.set_ref(name, &d)?;
                }
                Ok(true)
            })
            .await
            // Cannot fail: the task returns its errors; it panics only on a bug, which should stop the command.
            .expect("the layout writer thread does not panic")
            .map_err(CopyError::from)
        }
    }
}
