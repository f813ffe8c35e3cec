//! Carrying what refers to an image along with a copy: each referrer's blobs, then its manifest,
//! then its listing in the form the target supports (the referrers API indexes it by itself; the
//! fallback tag is read, merged and written again until it holds every entry; a layout lists it
//! untagged), and at the end the target's referrers compared with the source's.
use crate::local::layout::RefOrDigest;
use crate::transfer::endpoint::{CopyError, Endpoint, manifest_blobs};
use crate::transfer::progress::Progress;
use crate::transfer::push::{self, BlobOptions, Moved};
use crate::transfer::referrers::{self, Found, Link, Referrer};
use crate::transfer::remote::manifests::Manifest;
use crate::types::digest::Digest;
use crate::types::spec::{self, Descriptor, Index};
use futures_util::StreamExt;
use std::collections::BTreeMap;

/// How often the fallback tag's index is written again when a concurrent writer replaced it.
const FALLBACK_TRIES: usize = 5;

/// What carrying the referrers did, for `--json`.
#[derive(Debug, Clone, Default, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Carried {
    /// Referrers found at the source (after `--artifact-type`).
    pub found: usize,
    /// Referrer manifests written to the target (a merged cosign tag counts once).
    pub pushed: usize,
    /// Referrers the target had already.
    pub present: usize,
    /// How the target lists them: `api`, `fallback-tag` or `layout`.
    pub target_form: &'static str,
    pub blobs_uploaded: usize,
    pub bytes_uploaded: u64,
    /// Artifacts listed at the source that were not taken, one line each.
    pub skipped: Vec<String>,
}

/// Copies what refers to `roots` from `src` to `dst`, then checks the target has all of it.
pub async fn carry(
    src: &Endpoint,
    dst: &Endpoint,
    roots: &[Digest],
    artifact_type: Option<&str>,
    blob_options: &BlobOptions,
    quiet: bool,
) -> Result<Carried, CopyError> {
    let source = referrers::discover(src, roots, artifact_type).await?;
    let mut carried = Carried {
        found: source.referrers.len(),
        target_form: target_form(dst, roots).await?,
        skipped: source.skipped.clone(),
        ..Carried::default()
    };
    let mut blobs = BTreeMap::new();
    let mut to_put = Vec::new();
    let present: Vec<Result<bool, CopyError>> =
        futures_util::stream::iter(0..source.referrers.len())
            .map(|i| has(dst, &source.referrers[i]))
            .buffered(referrers::CONCURRENCY)
            .collect()
            .await;
    for (r, present) in source.referrers.iter().zip(present) {
        if present? {
            carried.present += 1;
            continue;
        }
        let (config, layers) = manifest_blobs(&src.name(), &r.manifest.bytes)?;
        for d in std::iter::once(config).chain(layers) {
            blobs.entry(d.digest).or_insert(d);
        }
        to_put.push(r);
    }
    let blobs: Vec<Descriptor> = blobs.into_values().collect();
    let progress = Progress::new(blobs.iter().map(|b| b.size).sum(), quiet);
    // A referrer's blobs are small: more of them at once than an image's layers.
    let small = BlobOptions {
        jobs: blob_options.jobs.max(referrers::CONCURRENCY),
        ..blob_options.clone()
    };
    let moved = push::move_blobs(src, dst, &blobs, &small, &progress).await;
    progress.finish();
    for (d, m) in moved? {
        if m == Moved::Uploaded {
            carried.blobs_uploaded += 1;
            carried.bytes_uploaded += d.size;
        }
    }
    // Parents before what refers to them (a level at a time, each level at once); the fallback
    // lists read, and written where they lack an entry, once each at the end.
    let mut listings: BTreeMap<Digest, Vec<Descriptor>> = BTreeMap::new();
    // A layout's index.json is read and replaced by each put: one at a time there.
    let at_once = match dst {
        Endpoint::Layout { .. } => 1,
        Endpoint::Registry { .. } => referrers::CONCURRENCY,
    };
    for depth in 0..referrers::MAX_DEPTH {
        let level: Vec<&Referrer> = to_put
            .iter()
            .copied()
            .filter(|r| r.depth == depth)
            .collect();
        let written: Vec<Result<Digest, CopyError>> = futures_util::stream::iter(0..level.len())
            .map(|i| put(dst, level[i]))
            .buffered(at_once)
            .collect()
            .await;
        for written in written {
            written?;
            carried.pushed += 1;
        }
    }
    // Every one listed, also one the target stored without listing it.
    for r in source.referrers.iter().filter(|r| r.link == Link::Subject) {
        listings.entry(r.subject).or_default().push(r.descriptor());
    }
    if carried.target_form == "fallback-tag" {
        let added: Vec<Result<(), CopyError>> = futures_util::stream::iter(listings)
            .map(|(subject, entries)| async move { add_to_fallback(dst, &subject, &entries).await })
            .buffered(referrers::CONCURRENCY)
            .collect()
            .await;
        added.into_iter().collect::<Result<(), CopyError>>()?;
    }
    let missing = lacking(dst, &source, carried.target_form == "api").await?;
    if !missing.is_empty() {
        return Err(CopyError::ReferrersMissing {
            target: dst.name(),
            missing: missing.join(", "),
        });
    }
    Ok(carried)
}

/// The blobs of an artifact made here (a signature, an attachment), in a temporary layout, so they
/// move to the target as any copy's do.
pub struct Staging {
    layout: crate::local::layout::Layout,
    blobs: Vec<Descriptor>,
    _dir: tempfile::TempDir,
}

impl Staging {
    pub fn new() -> Result<Staging, CopyError> {
        let dir = tempfile::tempdir().map_err(|e| CopyError::Task(e.to_string()))?;
        let layout = crate::local::layout::Layout::create(dir.path())?;
        Ok(Staging {
            layout,
            blobs: Vec::new(),
            _dir: dir,
        })
    }

    /// Adds a blob from memory; returns its digest and size.
    pub fn add(&mut self, bytes: &[u8]) -> Result<(Digest, u64), CopyError> {
        let committed = self.layout.write_blob(bytes)?;
        self.note(committed.digest, committed.size)
    }

    /// Adds a file's bytes, streamed; returns its digest and size.
    pub fn add_file(&mut self, path: &std::path::Path) -> Result<(Digest, u64), CopyError> {
        let mut file = std::fs::File::open(path).map_err(|e| CopyError::Input {
            path: path.to_path_buf(),
            detail: crate::io_detail(&e),
        })?;
        let mut w = self.layout.blob_writer()?;
        std::io::copy(&mut file, &mut w).map_err(|e| CopyError::Input {
            path: path.to_path_buf(),
            detail: crate::io_detail(&e),
        })?;
        let committed = w.commit(None)?;
        self.note(committed.digest, committed.size)
    }

    fn note(&mut self, digest: Digest, size: u64) -> Result<(Digest, u64), CopyError> {
        if !self.blobs.iter().any(|b| b.digest == digest) {
            self.blobs
                .push(Descriptor::new("application/octet-stream", digest, size));
        }
        Ok((digest, size))
    }
}

/// Writes an artifact made here to `dst`: its staged blobs, then its manifest, then its listing.
/// Returns the digest now under its tag or digest (a cosign tag's merged manifest).
pub async fn publish(
    dst: &Endpoint,
    r: &Referrer,
    staging: &Staging,
    blob_options: &BlobOptions,
) -> Result<Digest, CopyError> {
    let staged = Endpoint::Layout {
        layout: staging.layout.clone(),
        image: RefOrDigest::Digest(r.manifest.digest),
        name: "the artifact made here".into(),
        writing: None,
    };
    let progress = Progress::new(0, true);
    push::move_blobs(&staged, dst, &staging.blobs, blob_options, &progress).await?;
    let written = put(dst, r).await?;
    if r.link == Link::Subject && target_form(dst, &[r.subject]).await? == "fallback-tag" {
        add_to_fallback(dst, &r.subject, &[r.descriptor()]).await?;
    }
    Ok(written)
}

/// What of `source` the target lacks, asked of it directly: each subject's listing there, each
/// referrer's manifest, each cosign tag's layers (one request each, all `CONCURRENCY` at a time).
async fn lacking(dst: &Endpoint, source: &Found, api: bool) -> Result<Vec<String>, CopyError> {
    let by_subject: Vec<&Referrer> = (source.referrers.iter())
        .filter(|r| r.link == Link::Subject)
        .collect();
    let subjects: std::collections::BTreeSet<Digest> =
        by_subject.iter().map(|r| r.subject).collect();
    let listings: Vec<Result<_, CopyError>> = futures_util::stream::iter(subjects.iter().copied())
        .map(|s| async move { Ok((s, referrers::listed(dst, &s, api).await?)) })
        .buffered(referrers::CONCURRENCY)
        .collect()
        .await;
    let listings: BTreeMap<Digest, std::collections::BTreeSet<Digest>> =
        listings.into_iter().collect::<Result<_, _>>()?;
    let stored: Vec<Result<bool, CopyError>> =
        futures_util::stream::iter(by_subject.iter().map(|r| r.manifest.digest))
            .map(|digest| async move { has_manifest(dst, &digest).await })
            .buffered(referrers::CONCURRENCY)
            .collect()
            .await;
    let mut missing = Vec::new();
    for (r, stored) in by_subject.iter().zip(stored) {
        let listed = listings
            .get(&r.subject)
            .is_some_and(|l| l.contains(&r.manifest.digest));
        if !stored? || !listed {
            missing.push(format!("{} ({})", r.manifest.digest, r.artifact_type));
        }
    }
    let by_tag: Vec<(&String, &Referrer)> = (source.referrers.iter())
        .filter_map(|r| match &r.link {
            Link::Tag(tag) => Some((tag, r)),
            Link::Subject => None,
        })
        .collect();
    let ours: Vec<Result<Option<Manifest>, CopyError>> =
        futures_util::stream::iter(0..by_tag.len())
            .map(|i| tagged(dst, by_tag[i].0))
            .buffered(referrers::CONCURRENCY)
            .collect()
            .await;
    for ((tag, r), ours) in by_tag.into_iter().zip(ours) {
        missing.extend(referrers::tag_lacks(tag, &r.manifest, ours?.as_ref()));
    }
    Ok(missing)
}

/// Lists what refers to `roots` on `ep` (for `oci referrers`).
pub async fn list(
    ep: &Endpoint,
    roots: &[Digest],
    artifact_type: Option<&str>,
) -> Result<Found, CopyError> {
    referrers::discover(ep, roots, artifact_type).await
}

/// How `dst` lists referrers.
async fn target_form(dst: &Endpoint, roots: &[Digest]) -> Result<&'static str, CopyError> {
    Ok(match dst {
        Endpoint::Layout { .. } => "layout",
        Endpoint::Registry { client, reference } => {
            let probe = roots.first().copied().unwrap_or_else(|| Digest::of(b""));
            match client.get_referrers(&reference.repo, &probe).await? {
                Some(_) => "api",
                None => "fallback-tag",
            }
        }
    })
}

/// Whether the target holds this referrer already (a cosign tag: every one of its layers).
async fn has(dst: &Endpoint, r: &Referrer) -> Result<bool, CopyError> {
    match &r.link {
        Link::Subject => has_manifest(dst, &r.manifest.digest).await,
        Link::Tag(tag) => Ok(match tagged(dst, tag).await? {
            Some(current) => {
                current.digest == r.manifest.digest
                    || referrers::merge_tagged(&current, &r.manifest).is_none()
            }
            None => false,
        }),
    }
}

/// Whether the target stores the manifest (in a layout: as a blob listed untagged).
async fn has_manifest(dst: &Endpoint, digest: &Digest) -> Result<bool, CopyError> {
    match dst {
        Endpoint::Registry { client, reference } => Ok(client
            .head_manifest(&reference.repo, &digest.to_string(), true)
            .await?
            .is_some()),
        Endpoint::Layout { layout, .. } => Ok(layout.has_blob(digest)
            && layout
                .index()?
                .manifests
                .iter()
                .any(|d| d.digest == *digest && d.ref_name().is_none())),
    }
}

/// The manifest under `tag` at the target, if any.
async fn tagged(dst: &Endpoint, tag: &str) -> Result<Option<Manifest>, CopyError> {
    match dst {
        Endpoint::Registry { client, reference } => {
            Ok(client.get_manifest_if_any(&reference.repo, tag).await?)
        }
        Endpoint::Layout { layout, .. } => {
            let Ok(RefOrDigest::Name(name)) = RefOrDigest::parse(tag) else {
                return Ok(None);
            };
            let Ok(d) = layout.resolve(&RefOrDigest::Name(name)) else {
                return Ok(None);
            };
            let bytes = layout.read_blob(&d.digest, Some(d.size))?;
            Ok(Some(Manifest {
                bytes,
                media_type: d.media_type,
                digest: d.digest,
            }))
        }
    }
}

/// Writes one referrer's manifest: by digest (listed untagged in a layout), or under its cosign
/// tag, merged with what a concurrent signer put there. Returns the digest written.
async fn put(dst: &Endpoint, r: &Referrer) -> Result<Digest, CopyError> {
    let (m, tag) = match &r.link {
        Link::Subject => (r.manifest.clone(), None),
        Link::Tag(tag) => {
            let merged = match tagged(dst, tag).await? {
                Some(current) => referrers::merge_tagged(&current, &r.manifest),
                None => None,
            };
            (
                merged.unwrap_or_else(|| r.manifest.clone()),
                Some(tag.clone()),
            )
        }
    };
    let written = m.digest;
    match dst {
        Endpoint::Registry { client, reference } => {
            let at = tag.clone().unwrap_or_else(|| m.digest.to_string());
            client.put_manifest(&reference.repo, &at, &m).await?;
        }
        Endpoint::Layout { layout, .. } => {
            let (layout, descriptor) = (layout.clone(), r.descriptor());
            let d = Descriptor::new(&m.media_type, m.digest, m.bytes.len() as u64);
            tokio::task::spawn_blocking(move || -> Result<(), CopyError> {
                layout.write_blob(&m.bytes)?;
                // The destination's writer lock is held for the whole copy.
                match tag {
                    Some(tag) => layout.set_ref(&tag, &d)?,
                    None => layout.add_untagged(&descriptor)?,
                }
                Ok(())
            })
            .await
            .map_err(|e| CopyError::Task(e.to_string()))??;
        }
    }
    Ok(written)
}

/// Adds `entries` to the fallback tag's index of `subject`, read and written again until a read
/// shows every entry (a concurrent writer's entries are kept, ours put back if it dropped them).
async fn add_to_fallback(
    dst: &Endpoint,
    subject: &Digest,
    entries: &[Descriptor],
) -> Result<(), CopyError> {
    let Endpoint::Registry { client, reference } = dst else {
        return Ok(());
    };
    let tag = referrers::fallback_tag(subject);
    for _ in 0..FALLBACK_TRIES {
        let mut index = match client.get_manifest_if_any(&reference.repo, &tag).await? {
            Some(m) => serde_json::from_slice::<Index>(&m.bytes)
                .ok()
                .filter(|_| spec::is_index(&m.media_type))
                .ok_or_else(|| CopyError::FallbackNotIndex {
                    target: dst.name(),
                    tag: tag.clone(),
                })?,
            None => Index::empty(),
        };
        let lacking: Vec<&Descriptor> = entries
            .iter()
            .filter(|e| !index.manifests.iter().any(|d| d.digest == e.digest))
            .collect();
        if lacking.is_empty() {
            return Ok(());
        }
        index.manifests.extend(lacking.into_iter().cloned());
        index.media_type = Some(spec::MEDIA_TYPE_INDEX.to_string());
        let bytes = spec::to_json_bytes(&index);
        let m = Manifest {
            digest: Digest::of(&bytes),
            bytes,
            media_type: spec::MEDIA_TYPE_INDEX.to_string(),
        };
        client.put_manifest(&reference.repo, &tag, &m).await?;
    }
    Err(CopyError::FallbackContended {
        target: dst.name(),
        tag,
        tries: FALLBACK_TRIES,
    })
}
