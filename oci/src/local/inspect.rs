//! What `oci inspect` shows of a manifest or an index: a stable JSON schema (docs/oci.md) and its text form.
use crate::local::build::{self, BuildError};
use crate::local::layout::{Layout, RefOrDigest};
use crate::types::digest::Digest;
use crate::types::spec::{self, Descriptor, Index};
use crate::types::text::printable;
use serde::Serialize;
use serde_json::Value;
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// A summary of an image document, tagged by `kind` in JSON.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Inspection {
    /// A single-platform image.
    Manifest(Box<ManifestSummary>),
    /// A multi-platform image.
    Index(IndexSummary),
}

/// A manifest with the parts of its config that say how the image runs.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ManifestSummary {
    /// The manifest's digest.
    pub digest: Digest,
    /// The manifest's media type.
    pub media_type: String,
    /// The manifest's size in bytes.
    pub size: u64,
    /// `OS/ARCH[/VARIANT]` from the config.
    pub platform: String,
    /// The config's `created` time, if any.
    pub created: Option<String>,
    /// The config's entrypoint (empty when unset).
    pub entrypoint: Vec<String>,
    /// The config's cmd (empty when unset).
    pub cmd: Vec<String>,
    /// The config's environment, `K=V` each.
    pub env: Vec<String>,
    /// The config's working directory, if any.
    pub working_dir: Option<String>,
    /// The config's labels.
    pub labels: BTreeMap<String, String>,
    /// The config's descriptor.
    pub config: Descriptor,
    /// The layers, base first.
    pub layers: Vec<Descriptor>,
}

/// An index and the platform of each manifest it lists.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct IndexSummary {
    /// The index's digest.
    pub digest: Digest,
    /// The index's media type.
    pub media_type: String,
    /// The index's size in bytes.
    pub size: u64,
    /// The manifests, in the index's order.
    pub manifests: Vec<IndexEntry>,
}

/// One manifest of an index.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct IndexEntry {
    /// `OS/ARCH[/VARIANT]`, or null when the index does not say.
    pub platform: Option<String>,
    /// The manifest's digest.
    pub digest: Digest,
    /// The manifest's media type.
    pub media_type: String,
    /// The manifest's size in bytes.
    pub size: u64,
}

fn strings(v: Option<&Value>) -> Vec<String> {
    v.and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// Summarizes a manifest from its verified descriptor, and its config document.
pub fn summarize_manifest(
    descriptor: &Descriptor,
    config: &Descriptor,
    layers: &[Descriptor],
    config_json: &Value,
) -> ManifestSummary {
    let run = config_json.get("config");
    let field = |k: &str| run.and_then(|r| r.get(k));
    ManifestSummary {
        digest: descriptor.digest,
        media_type: descriptor.media_type.clone(),
        size: descriptor.size,
        platform: build::config_platform(config_json).to_string(),
        created: config_json
            .get("created")
            .and_then(Value::as_str)
            .map(str::to_string),
        entrypoint: strings(field("Entrypoint")),
        cmd: strings(field("Cmd")),
        env: strings(field("Env")),
        working_dir: field("WorkingDir")
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .map(str::to_string),
        labels: field("Labels")
            .and_then(Value::as_object)
            .map(|m| {
                m.iter()
                    .filter_map(|(k, v)| v.as_str().map(|v| (k.clone(), v.to_string())))
                    .collect()
            })
            .unwrap_or_default(),
        config: config.clone(),
        layers: layers.to_vec(),
    }
}

/// Summarizes an index from its descriptor and parsed document.
pub fn summarize_index(descriptor: &Descriptor, index: &Index) -> IndexSummary {
    IndexSummary {
        digest: descriptor.digest,
        media_type: descriptor.media_type.clone(),
        size: descriptor.size,
        manifests: index
            .manifests
            .iter()
            .map(|d| IndexEntry {
                platform: d.platform.as_ref().map(ToString::to_string),
                digest: d.digest,
                media_type: d.media_type.clone(),
                size: d.size,
            })
            .collect(),
    }
}

/// Inspects an image of a local layout; returns the summary and the document's exact stored bytes.
pub fn inspect_layout(
    layout: &Layout,
    image: &RefOrDigest,
) -> Result<(Inspection, Vec<u8>), BuildError> {
    let descriptor = layout.resolve(image)?;
    let raw = layout.read_blob(&descriptor.digest, Some(descriptor.size))?;
    if spec::is_index(&descriptor.media_type) {
        let index: Index = serde_json::from_slice(&raw).map_err(|e| BuildError::BadDocument {
            what: "index",
            digest: descriptor.digest,
            msg: e.to_string(),
        })?;
        return Ok((Inspection::Index(summarize_index(&descriptor, &index)), raw));
    }
    let docs = build::read_image(layout, &descriptor)?;
    let summary = summarize_manifest(&descriptor, &docs.config, &docs.layers, &docs.config_json);
    Ok((Inspection::Manifest(Box::new(summary)), raw))
}

impl Inspection {
    /// The human-readable form: one `name: value` per line, layers and manifests indented below.
    pub fn text(&self) -> String {
        let mut s = String::new();
        // JSON escapes the controls below 0x20 but not DEL or the C1 controls: printable does.
        // Cannot fail: a list of strings always serializes.
        let list = |v: &[String]| {
            printable(&serde_json::to_string(v).expect("strings serialize")).into_owned()
        };
        match self {
            Inspection::Manifest(m) => {
                let _ = writeln!(s, "digest:      {}", m.digest);
                let _ = writeln!(s, "media type:  {}", printable(&m.media_type));
                let _ = writeln!(s, "platform:    {}", printable(&m.platform));
                let created = m.created.as_deref().unwrap_or("-");
                let _ = writeln!(s, "created:     {}", printable(created));
                let _ = writeln!(s, "entrypoint:  {}", list(&m.entrypoint));
                let _ = writeln!(s, "cmd:         {}", list(&m.cmd));
                let _ = writeln!(s, "env:         {}", list(&m.env));
                if let Some(w) = &m.working_dir {
                    let _ = writeln!(s, "workdir:     {}", printable(w));
                }
                for (k, v) in &m.labels {
                    let _ = writeln!(s, "label:       {}={}", printable(k), printable(v));
                }
                let _ = writeln!(s, "layers:");
                for l in &m.layers {
                    let _ = writeln!(s, "  {} {} {}", l.digest, printable(&l.media_type), l.size);
                }
            }
            Inspection::Index(i) => {
                let _ = writeln!(s, "digest:      {}", i.digest);
                let _ = writeln!(s, "media type:  {}", printable(&i.media_type));
                let _ = writeln!(s, "manifests:");
                for m in &i.manifests {
                    let platform = m.platform.as_deref().unwrap_or("-");
                    let _ = writeln!(s, "  {} {}", printable(platform), m.digest);
                }
            }
        }
        s
    }
}
