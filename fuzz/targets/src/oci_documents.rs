//! `oci_documents`: the JSON documents `oci` reads from a registry or a layout (descriptors,
//! manifests, indexes, configs, artifact manifests, cosign payloads). The input is one document,
//! optionally followed by a NUL and a second one (JSON holds no raw NUL) used as its config.
//!
//! Properties: a descriptor, index or platform read and written again (compact, field order)
//! reads back to the same value and the same bytes; the readers agree with each other (a
//! manifest's blobs are the artifact reader's config and layers); a cosign payload made for any
//! repository name reads back to its digest; merging a signature's layers is idempotent; as
//! `index.json` of a layout, a ref name resolves only to a descriptor of that name and a name of
//! two images is refused; `oci inspect` of the document (as the manifest of an image whose config
//! is the second document, or as an index) gives a summary whose text form is one line per
//! field.
use crate::support::{fresh_dir, sections};
use oci::local::inspect::{self, Inspection};
use oci::local::layout::{self, Layout, LayoutError};
use oci::signing::cosign;
use oci::transfer::endpoint;
use oci::transfer::referrers::{self, ArtifactManifest};
use oci::transfer::remote::manifests::Manifest;
use oci::types::spec::{self, Descriptor, Index, Platform};
use oci::{Digest, RefOrDigest};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

pub fn oci_documents(data: &[u8]) {
    let [doc, config] = sections::<2>(data, b"\0");
    serde_round_trip::<Descriptor>(doc);
    serde_round_trip::<Index>(doc);
    serde_round_trip::<Platform>(doc);
    readers_agree(doc);
    signatures(doc);
    as_index_json(doc);
    inspected(doc, config);
}

/// A document read, written as oci writes documents, and read again is the same value; written
/// again it is the same bytes.
fn serde_round_trip<T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug>(bytes: &[u8]) {
    let Ok(first) = serde_json::from_slice::<T>(bytes) else {
        return;
    };
    let written = spec::to_json_bytes(&first);
    let back: T = serde_json::from_slice(&written).expect("a written document reads back");
    assert_eq!(back, first, "{}", String::from_utf8_lossy(&written));
    assert_eq!(
        spec::to_json_bytes(&back),
        written,
        "written twice, the same bytes"
    );
}

fn readers_agree(doc: &[u8]) {
    let sniffed = layout::sniff_media_type(doc);
    let value: Option<Value> = serde_json::from_slice(doc).ok();
    if let Some(v) = &value {
        match v.get("mediaType").and_then(Value::as_str) {
            Some(m) => assert_eq!(sniffed.as_deref(), Some(m)),
            None if v.get("manifests").is_some() => {
                assert_eq!(sniffed.as_deref(), Some(spec::MEDIA_TYPE_INDEX));
            }
            None if v.get("layers").is_some() => {
                assert_eq!(sniffed.as_deref(), Some(spec::MEDIA_TYPE_MANIFEST));
            }
            None => assert_eq!(sniffed, None),
        }
    } else {
        assert_eq!(sniffed, None, "no media type from what is not JSON");
    }
    let artifact = ArtifactManifest::parse(doc);
    match endpoint::manifest_blobs("docker://registry.test/fuzz:doc", doc) {
        Ok((config, layers)) => {
            // The artifact reader wants more fields well-typed (subject, annotations); where
            // it reads the document, it reads the same blobs.
            if let Some(artifact) = artifact {
                assert_eq!(artifact.config.as_ref(), Some(&config));
                assert_eq!(artifact.layers, layers);
            }
        }
        Err(e) => {
            let line = e.to_string();
            assert!(line.contains("docker://registry.test/fuzz:doc"), "{line}");
        }
    }
}

fn signatures(doc: &[u8]) {
    let _ = cosign::signed_digest(doc);
    // The payload this crate signs names the image's digest whatever the repository's name.
    let digest = Digest::of(doc);
    let reference = String::from_utf8_lossy(doc.get(..200).unwrap_or(doc));
    let payload = cosign::payload(&reference, &digest);
    assert_eq!(cosign::signed_digest(&payload), Ok(digest));
    // Merging a signature manifest's layers into a manifest is idempotent.
    let manifest = |bytes: Vec<u8>| Manifest {
        digest: Digest::of(&bytes),
        bytes,
        media_type: spec::MEDIA_TYPE_MANIFEST.to_string(),
    };
    let source = manifest(doc.to_vec());
    let layers: Vec<Value> = serde_json::from_slice::<Value>(doc)
        .ok()
        .and_then(|v| v.get("layers").and_then(Value::as_array).cloned())
        .unwrap_or_default();
    assert!(
        referrers::merge_tagged(&source, &source).is_none(),
        "nothing to add from itself"
    );
    let empty = manifest(br#"{"schemaVersion":2,"layers":[]}"#.to_vec());
    match referrers::merge_tagged(&empty, &source) {
        None => assert!(layers.is_empty()),
        Some(merged) => {
            let got: Value = serde_json::from_slice(&merged.bytes).expect("merged is JSON");
            let mut distinct: Vec<Value> = Vec::new();
            for l in &layers {
                if !distinct.contains(l) {
                    distinct.push(l.clone());
                }
            }
            let merged_layers = got["layers"].as_array().expect("layers").clone();
            // Every layer of the source is there; a layer twice in the source may be added twice.
            for l in &distinct {
                assert!(merged_layers.contains(l));
            }
            assert_eq!(merged.digest, Digest::of(&merged.bytes));
            assert!(
                referrers::merge_tagged(&merged, &source).is_none(),
                "merging is idempotent"
            );
        }
    }
}

/// A layout of this thread's own, with the document as its `index.json`.
fn as_index_json(doc: &[u8]) {
    let dir = fresh_dir("oci_documents-layout");
    let layout = Layout::create(&dir).expect("a layout");
    std::fs::write(dir.join("index.json"), doc).expect("write index.json");
    let index = match layout.index() {
        Ok(index) => index,
        Err(e) => {
            assert!(matches!(e, LayoutError::Corrupt { .. }), "{e}");
            return;
        }
    };
    assert_eq!(
        layout.ref_names().expect("names of a readable index"),
        index
            .manifests
            .iter()
            .filter_map(|d| d.ref_name().map(str::to_string))
            .collect::<Vec<_>>()
    );
    for d in index.manifests.iter().take(16) {
        if let Some(name) = d.ref_name() {
            let asked = RefOrDigest::Name(name.to_string());
            let named: Vec<&Descriptor> = index
                .manifests
                .iter()
                .filter(|e| e.ref_name() == Some(name))
                .collect();
            match layout.resolve(&asked) {
                Ok(found) => {
                    assert_eq!(found.ref_name(), Some(name));
                    assert!(named.iter().all(|e| e.digest == found.digest));
                }
                Err(LayoutError::Ambiguous { digests, .. }) => {
                    assert!(digests.len() > 1);
                    assert!(named.iter().any(|e| e.digest != named[0].digest));
                }
                Err(e) => panic!("a name in index.json did not resolve: {e}"),
            }
        }
        match layout.resolve(&RefOrDigest::Digest(d.digest)) {
            Ok(found) => assert_eq!(found.digest, d.digest),
            Err(e) => panic!("a digest in index.json did not resolve: {e}"),
        }
    }
}

/// `oci inspect` of the document as an image's manifest (its config pointed at the second
/// document) or as an index, from a layout.
fn inspected(doc: &[u8], config: &[u8]) {
    let Ok(mut manifest) = serde_json::from_slice::<Value>(doc) else {
        return;
    };
    let dir = fresh_dir("oci_documents-inspect");
    let layout = Layout::create(&dir).expect("a layout");
    let put = |bytes: &[u8]| {
        let digest = Digest::of(bytes);
        std::fs::write(layout.blob_path(&digest), bytes).expect("write a blob");
        digest
    };
    let config_digest = put(config);
    if let Some(c) = manifest.get_mut("config").and_then(Value::as_object_mut) {
        c.insert("digest".into(), Value::String(config_digest.to_string()));
        c.insert("size".into(), Value::from(config.len() as u64));
    }
    let bytes = spec::to_json_bytes(&manifest);
    let digest = put(&bytes);
    let media_type =
        layout::sniff_media_type(&bytes).unwrap_or_else(|| spec::MEDIA_TYPE_MANIFEST.to_string());
    let mut descriptor = Descriptor::new(&media_type, digest, bytes.len() as u64);
    descriptor
        .annotations
        .insert(spec::ANNOTATION_REF_NAME.into(), "fuzz".into());
    let index = Index {
        manifests: vec![descriptor],
        ..Index::empty()
    };
    std::fs::write(dir.join("index.json"), spec::to_json_bytes(&index)).expect("write index.json");
    for asked in [
        RefOrDigest::Name("fuzz".into()),
        RefOrDigest::Digest(digest),
    ] {
        let Ok((inspection, raw)) = inspect::inspect_layout(&layout, &asked) else {
            continue;
        };
        assert_eq!(raw, bytes, "inspect shows the stored bytes");
        serde_json::to_vec(&inspection).expect("the --json schema serializes");
        let text = inspection.text();
        let lines = text.lines().count();
        let expected = match &inspection {
            Inspection::Manifest(m) => {
                8 + usize::from(m.working_dir.is_some()) + m.labels.len() + m.layers.len()
            }
            Inspection::Index(i) => 3 + i.manifests.len(),
        };
        assert_eq!(
            lines, expected,
            "inspect's text is one line per field:\n{text}"
        );
        assert!(
            !text.chars().any(|c| c.is_control() && c != '\n'),
            "inspect's text holds a control character:\n{text:?}"
        );
        if let Inspection::Manifest(m) = &inspection {
            let config_json: Value = serde_json::from_slice(config).expect("a read config is JSON");
            let platform = oci::local::build::config_platform(&config_json).to_string();
            assert_eq!(m.platform, platform);
        }
    }
}
