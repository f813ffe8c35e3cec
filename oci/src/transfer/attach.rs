//! `oci attach`: an artifact (one file) whose subject is an image, pushed to a registry (listed
//! through the referrers API or its fallback tag) or into a layout (listed untagged).
use crate::transfer::carry::{self, Staging};
use crate::transfer::endpoint::{CopyError, Endpoint};
use crate::transfer::push::BlobOptions;
use crate::transfer::referrers::{self, Link};
use crate::types::digest::Digest;
use crate::types::spec::{self, Descriptor, EMPTY_JSON};
use std::collections::BTreeMap;
use std::path::Path;

/// The title annotation, which names the attached file as oras names it.
pub const ANNOTATION_TITLE: &str = "org.opencontainers.image.title";

/// What to attach.
#[derive(Debug, Clone)]
pub struct Attachment<'a> {
    pub artifact_type: &'a str,
    pub file: &'a Path,
    /// The file's media type as a layer.
    pub media_type: &'a str,
    pub annotations: BTreeMap<String, String>,
}

/// Whether `s` has the shape of a media type (`type/subtype`, RFC 6838 characters).
pub fn is_media_type(s: &str) -> bool {
    let ok = |part: &str| {
        !part.is_empty()
            && part.len() <= 127
            && part
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "!#$&-^_.+".contains(c))
    };
    matches!(s.split_once('/'), Some((t, sub)) if ok(t) && ok(sub))
}

/// Attaches the file to the image `ep` names; returns the artifact manifest's digest.
pub async fn attach(
    ep: &Endpoint,
    what: &Attachment<'_>,
    blob_options: &BlobOptions,
) -> Result<Digest, CopyError> {
    let image = ep.top_manifest().await?;
    let mut staging = Staging::new()?;
    let (digest, size) = staging.add_file(what.file)?;
    staging.add(EMPTY_JSON)?;
    let mut layer = Descriptor::new(what.media_type, digest, size);
    if let Some(name) = what.file.file_name() {
        layer
            .annotations
            .insert(ANNOTATION_TITLE.into(), name.to_string_lossy().into_owned());
    }
    let mut doc = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": spec::MEDIA_TYPE_MANIFEST,
        "artifactType": what.artifact_type,
        "config": spec::empty_config(),
        "layers": [layer],
        "subject": Descriptor::new(&image.media_type, image.digest, image.bytes.len() as u64),
    });
    if !what.annotations.is_empty() {
        doc["annotations"] = serde_json::to_value(&what.annotations).unwrap_or_default();
    }
    let mut r = referrers::referrer(
        &image,
        spec::to_json_bytes(&doc),
        Link::Subject,
        what.artifact_type,
    );
    r.annotations = what.annotations.clone();
    carry::publish(ep, &r, &staging, blob_options).await
}
