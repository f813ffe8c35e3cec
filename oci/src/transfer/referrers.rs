//! What refers to an image (signatures, SBOMs, attestations): found through the OCI 1.1 referrers
//! API, its fallback tag `sha256-<hex>`, cosign's `sha256-<hex>.sig|.att|.sbom` tags, or a layout's
//! untagged `index.json` entries. A referrer is taken only when its manifest's `subject` is the
//! digest it was listed for; the walk is bounded in depth and count.
use crate::local::layout::Layout;
use crate::transfer::endpoint::{CopyError, Endpoint};
use crate::transfer::remote::manifests::Manifest;
use crate::types::digest::Digest;
use crate::types::spec::{self, Descriptor, Index};
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// How deep the walk goes: an image, its signature, the signature's attestation, ...
pub const MAX_DEPTH: usize = 4;
/// The most referrers one image may carry through a walk.
pub const MAX_REFERRERS: usize = 512;
/// Requests to one registry under way at once in a walk.
pub const CONCURRENCY: usize = 16;
/// cosign's tag suffixes: signatures, attestations, SBOMs.
pub const COSIGN_SUFFIXES: [&str; 3] = ["sig", "att", "sbom"];

/// How a referrer is tied to what it refers to.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Link {
    /// Its manifest's `subject` names it (the referrers API, the fallback tag, a layout).
    Subject,
    /// cosign's tag `sha256-<hex>.SUFFIX` names it.
    Tag(String),
}

/// One artifact that refers to an image (or to another referrer).
#[derive(Debug, Clone)]
pub struct Referrer {
    /// The digest it refers to.
    pub subject: Digest,
    /// Its manifest's exact bytes.
    pub manifest: Manifest,
    /// The manifest's `artifactType`, else its config's media type; for a cosign tag, its first
    /// layer's media type (cosign's config type says nothing).
    pub artifact_type: String,
    pub annotations: BTreeMap<String, String>,
    pub link: Link,
    /// 0 for what refers to the image itself.
    pub depth: usize,
}

impl Referrer {
    /// Its descriptor as a referrers index lists it.
    pub fn descriptor(&self) -> Descriptor {
        let mut d = Descriptor::new(
            &self.manifest.media_type,
            self.manifest.digest,
            self.manifest.bytes.len() as u64,
        );
        d.extra.insert(
            "artifactType".into(),
            serde_json::Value::String(self.artifact_type.clone()),
        );
        d.annotations = self.annotations.clone();
        d
    }
}

/// A walk's result: the referrers in walk order (parents before what refers to them) and one line
/// for each listed artifact that was not taken.
#[derive(Debug, Default)]
pub struct Found {
    pub referrers: Vec<Referrer>,
    pub skipped: Vec<String>,
}

/// The fields of a manifest that tie it to a subject.
#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct ArtifactManifest {
    #[serde(default)]
    pub artifact_type: Option<String>,
    #[serde(default)]
    pub config: Option<Descriptor>,
    #[serde(default)]
    pub layers: Vec<Descriptor>,
    #[serde(default)]
    pub subject: Option<Descriptor>,
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
}

impl ArtifactManifest {
    pub fn parse(bytes: &[u8]) -> Option<ArtifactManifest> {
        serde_json::from_slice(bytes).ok()
    }

    fn artifact_type(&self) -> String {
        self.artifact_type
            .clone()
            .or_else(|| self.config.as_ref().map(|c| c.media_type.clone()))
            .unwrap_or_default()
    }
}

/// The fallback tag that lists the referrers of `digest` where the registry has no API.
pub fn fallback_tag(digest: &Digest) -> String {
    format!("sha256-{}", digest.hex())
}

/// cosign's tag for `digest` with `suffix` (`sig`, `att`, `sbom`).
pub fn cosign_tag(digest: &Digest, suffix: &str) -> String {
    format!("sha256-{}.{suffix}", digest.hex())
}

/// Walks what refers to `roots` on `ep`, keeping at depth 0 only `artifact_type` when given (what
/// refers to a kept referrer comes with it).
pub async fn discover(
    ep: &Endpoint,
    roots: &[Digest],
    artifact_type: Option<&str>,
) -> Result<Found, CopyError> {
    let mut found = Found::default();
    let mut seen: BTreeSet<(Link, Digest)> = BTreeSet::new();
    let mut level: Vec<Digest> = roots.to_vec();
    // Whether the registry offers the referrers API is asked once, not for every subject.
    let api = match roots.first() {
        Some(first) => has_api(ep, first).await?,
        None => false,
    };
    for depth in 0..MAX_DEPTH {
        let mut next = Vec::new();
        // The subjects of one level are asked about at once; their answers are taken in order.
        let answers: Vec<Result<Direct, CopyError>> =
            futures_util::stream::iter(level.iter().copied())
                .map(|subject| async move { direct(ep, &subject, depth, api).await })
                .buffered(CONCURRENCY)
                .collect()
                .await;
        for answer in answers {
            let (referrers, skipped) = answer?;
            found.skipped.extend(skipped);
            for r in referrers {
                if depth == 0 && artifact_type.is_some_and(|t| t != r.artifact_type) {
                    continue;
                }
                if !seen.insert((r.link.clone(), r.manifest.digest)) {
                    continue;
                }
                if found.referrers.len() == MAX_REFERRERS {
                    return Err(CopyError::TooManyReferrers {
                        image: ep.name(),
                        limit: MAX_REFERRERS,
                    });
                }
                next.push(r.manifest.digest);
                found.referrers.push(r);
            }
        }
        if next.is_empty() {
            break;
        }
        level = next;
    }
    Ok(found)
}

/// Whether `ep` is a registry that offers the referrers API (asked about `digest`).
pub async fn has_api(ep: &Endpoint, digest: &Digest) -> Result<bool, CopyError> {
    Ok(match ep {
        Endpoint::Registry { client, reference } => client
            .get_referrers(&reference.repo, digest)
            .await?
            .is_some(),
        Endpoint::Layout { .. } => false,
    })
}

/// The digests `ep` lists as referring to `subject`: the API's or the fallback tag's listing of
/// a registry, or a layout's untagged manifests whose subject it is.
pub async fn listed(
    ep: &Endpoint,
    subject: &Digest,
    api: bool,
) -> Result<BTreeSet<Digest>, CopyError> {
    match ep {
        Endpoint::Registry { client, reference } if api => Ok(client
            .get_referrers(&reference.repo, subject)
            .await?
            .map(|index| index.manifests.iter().map(|d| d.digest).collect())
            .unwrap_or_default()),
        Endpoint::Registry { .. } => Ok(fallback_entries(ep, subject, &mut Vec::new())
            .await?
            .iter()
            .map(|d| d.digest)
            .collect()),
        Endpoint::Layout { .. } => Ok(direct(ep, subject, 0, false)
            .await?
            .0
            .into_iter()
            .filter(|r| r.link == Link::Subject)
            .map(|r| r.manifest.digest)
            .collect()),
    }
}

/// What refers to one subject directly, and the lines for what was listed but not taken.
type Direct = (Vec<Referrer>, Vec<String>);

/// What refers to `subject` directly: the listing (the API's where `api`, else the fallback tag's)
/// and cosign's tags asked at once, then the listed manifests read `CONCURRENCY` at a time.
async fn direct(
    ep: &Endpoint,
    subject: &Digest,
    depth: usize,
    api: bool,
) -> Result<Direct, CopyError> {
    let mut out = Vec::new();
    let mut skipped = Vec::new();
    match ep {
        Endpoint::Registry { client, reference } => {
            let repo = &reference.repo;
            let listing = async {
                let mut skipped = Vec::new();
                let listed = if api {
                    (client.get_referrers(repo, subject).await?)
                        .map(|index| index.manifests)
                        .unwrap_or_default()
                } else {
                    fallback_entries(ep, subject, &mut skipped).await?
                };
                Ok::<_, CopyError>((listed, skipped))
            };
            let tags = futures_util::future::try_join_all(COSIGN_SUFFIXES.iter().map(
                |suffix| async move {
                    let tag = cosign_tag(subject, suffix);
                    let m = client.get_manifest_if_any(repo, &tag).await?;
                    Ok::<_, CopyError>(m.map(|m| (tag, m)))
                },
            ));
            let ((listed, listing_skipped), tagged) =
                futures_util::future::try_join(listing, tags).await?;
            skipped.extend(listing_skipped);
            let manifests: Vec<_> = futures_util::stream::iter(listed)
                .map(|d| async move { client.get_manifest(repo, &d.digest.to_string()).await })
                .buffered(CONCURRENCY)
                .collect()
                .await;
            for m in manifests {
                if let Some(r) = by_subject(ep, subject, m?, depth, &mut skipped) {
                    out.push(r);
                }
            }
            for (tag, m) in tagged.into_iter().flatten() {
                out.extend(by_tag(ep, subject, tag, m, depth, &mut skipped));
            }
        }
        Endpoint::Layout { layout, .. } => {
            let layout = layout.clone();
            let subject = *subject;
            let entries = tokio::task::spawn_blocking(move || layout_entries(&layout, &subject))
                .await
                .map_err(|e| CopyError::Task(e.to_string()))??;
            for (name, m) in entries {
                match name {
                    // In a layout, an untagged entry that refers to something else is no news.
                    None => {
                        let mut ignored = Vec::new();
                        out.extend(by_subject(ep, &subject, m, depth, &mut ignored));
                    }
                    Some(tag) => out.extend(by_tag(ep, &subject, tag, m, depth, &mut skipped)),
                }
            }
        }
    }
    Ok((out, skipped))
}

/// The entries of the fallback tag's index, or none.
async fn fallback_entries(
    ep: &Endpoint,
    subject: &Digest,
    skipped: &mut Vec<String>,
) -> Result<Vec<Descriptor>, CopyError> {
    let Endpoint::Registry { client, reference } = ep else {
        return Ok(Vec::new());
    };
    let tag = fallback_tag(subject);
    let Some(m) = client.get_manifest_if_any(&reference.repo, &tag).await? else {
        return Ok(Vec::new());
    };
    match serde_json::from_slice::<Index>(&m.bytes) {
        Ok(index) if spec::is_index(&m.media_type) => Ok(index.manifests),
        _ => {
            skipped.push(format!(
                "{}: the fallback tag {tag} holds a {}, not an index of referrers; ignored",
                ep.name(),
                m.media_type
            ));
            Ok(Vec::new())
        }
    }
}

/// The manifest as a referrer of `subject` if its own `subject` says so; else a line why not.
fn by_subject(
    ep: &Endpoint,
    subject: &Digest,
    m: Manifest,
    depth: usize,
    skipped: &mut Vec<String>,
) -> Option<Referrer> {
    let parsed = if spec::is_manifest(&m.media_type) || spec::is_index(&m.media_type) {
        ArtifactManifest::parse(&m.bytes)
    } else {
        None
    };
    let Some(parsed) = parsed else {
        skipped.push(format!(
            "{}: {} listed as a referrer of {subject} is not a manifest; skipped",
            ep.name(),
            m.digest
        ));
        return None;
    };
    match &parsed.subject {
        Some(s) if s.digest == *subject => Some(Referrer {
            subject: *subject,
            artifact_type: parsed.artifact_type(),
            annotations: parsed.annotations,
            manifest: m,
            link: Link::Subject,
            depth,
        }),
        Some(s) => {
            skipped.push(format!(
                "{}: {} listed as a referrer of {subject} names subject {}; skipped",
                ep.name(),
                m.digest,
                s.digest
            ));
            None
        }
        None => {
            skipped.push(format!(
                "{}: {} listed as a referrer of {subject} has no subject (an image's own manifest, not a referrer); skipped",
                ep.name(),
                m.digest
            ));
            None
        }
    }
}

/// The manifest under cosign's tag for `subject`, which names its subject by the tag alone.
fn by_tag(
    ep: &Endpoint,
    subject: &Digest,
    tag: String,
    m: Manifest,
    depth: usize,
    skipped: &mut Vec<String>,
) -> Option<Referrer> {
    let parsed = spec::is_manifest(&m.media_type)
        .then(|| ArtifactManifest::parse(&m.bytes))
        .flatten();
    let Some(parsed) = parsed else {
        skipped.push(format!(
            "{}: the tag {tag} holds a {}, not a manifest; skipped",
            ep.name(),
            m.media_type
        ));
        return None;
    };
    let artifact_type = parsed
        .artifact_type
        .clone()
        .or_else(|| parsed.layers.first().map(|l| l.media_type.clone()))
        .unwrap_or_else(|| parsed.artifact_type());
    Some(Referrer {
        subject: *subject,
        artifact_type,
        annotations: parsed.annotations,
        manifest: m,
        link: Link::Tag(tag),
        depth,
    })
}

/// A layout's candidates for `subject`: every untagged manifest (None) and cosign's tags for it.
fn layout_entries(
    layout: &Layout,
    subject: &Digest,
) -> Result<Vec<(Option<String>, Manifest)>, CopyError> {
    let tags: Vec<String> = COSIGN_SUFFIXES
        .iter()
        .map(|s| cosign_tag(subject, s))
        .collect();
    let mut out = Vec::new();
    for d in layout.index()?.manifests {
        let name = match d.ref_name() {
            None if d.digest != *subject => None,
            Some(n) if tags.iter().any(|t| t == n) => Some(n.to_string()),
            _ => continue,
        };
        let bytes = layout.read_blob(&d.digest, Some(d.size))?;
        let media_type = crate::local::layout::sniff_media_type(&bytes).unwrap_or(d.media_type);
        out.push((
            name,
            Manifest {
                bytes,
                media_type,
                digest: d.digest,
            },
        ));
    }
    Ok(out)
}

/// The layers of cosign tag manifest `theirs` that `ours` (the target's manifest under that tag,
/// if any) lacks, one line each.
pub fn tag_lacks(tag: &str, theirs: &Manifest, ours: Option<&Manifest>) -> Vec<String> {
    let have = ours.map(layers).unwrap_or_default();
    layers(theirs)
        .into_iter()
        .filter(|l| !have.contains(l))
        .map(|l| {
            let digest = l.get("digest").and_then(|d| d.as_str()).unwrap_or("?");
            format!("layer {digest} under tag {tag}")
        })
        .collect()
}

/// A manifest's layer descriptors as they are written: two signatures over one payload share a
/// digest and differ in their annotation, so a layer is told apart by its whole descriptor.
fn layers(m: &Manifest) -> Vec<serde_json::Value> {
    serde_json::from_slice::<serde_json::Value>(&m.bytes)
        .ok()
        .and_then(|v| v.get("layers").and_then(|l| l.as_array()).cloned())
        .unwrap_or_default()
}

/// `target` (a manifest under a cosign tag) with the layers of `source` it lacks appended, or None
/// when it has them all: two writers' signatures are kept side by side, as cosign appends them.
/// The target's config is kept as it is (cosign reads a signature's layers, not its config).
pub fn merge_tagged(target: &Manifest, source: &Manifest) -> Option<Manifest> {
    let mut doc: serde_json::Value = serde_json::from_slice(&target.bytes).ok()?;
    let have = layers(target);
    let add: Vec<serde_json::Value> = layers(source)
        .into_iter()
        .filter(|l| !have.contains(l))
        .collect();
    if add.is_empty() {
        return None;
    }
    doc.get_mut("layers")?.as_array_mut()?.extend(add);
    let bytes = spec::to_json_bytes(&doc);
    Some(Manifest {
        digest: Digest::of(&bytes),
        bytes,
        media_type: target.media_type.clone(),
    })
}

/// A referrer of `image` made here from its manifest bytes.
pub fn referrer(image: &Manifest, bytes: Vec<u8>, link: Link, artifact_type: &str) -> Referrer {
    Referrer {
        subject: image.digest,
        manifest: Manifest {
            digest: Digest::of(&bytes),
            bytes,
            media_type: spec::MEDIA_TYPE_MANIFEST.to_string(),
        },
        artifact_type: artifact_type.to_string(),
        annotations: BTreeMap::new(),
        link,
        depth: 0,
    }
}
