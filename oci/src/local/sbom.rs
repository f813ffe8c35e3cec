//! `oci build --sbom`: an SPDX 2.3 JSON document listing the new layer's regular files, attached
//! to the image in its layout as an OCI 1.1 referrer (an artifact manifest whose `subject` is it).
//!
//! Every byte comes from the layer and the digests: no host path, clock or order reaches it.
use crate::local::layer::LayerFile;
use crate::local::layout::{Layout, LayoutError, Rollback};
use crate::types::digest::Digest;
use crate::types::spec::{self, Descriptor, EMPTY_JSON};
use serde_json::{Value, json};
use sha1::{Digest as _, Sha1};

/// The media type (and artifact type) of an SPDX JSON document.
pub const MEDIA_TYPE_SPDX: &str = "application/spdx+json";
/// The annotation that dates the SBOM's manifest.
pub const ANNOTATION_CREATED: &str = "org.opencontainers.image.created";
/// Where document namespaces live: a reserved domain, so no one mistakes one for a download.
const NAMESPACE_BASE: &str = "https://fleet.invalid/spdx/";

/// The image an SBOM describes.
#[derive(Debug, Clone, Copy)]
pub struct Described<'a> {
    /// The ref name the image was built under (the package's name).
    pub name: &'a str,
    /// The image's manifest.
    pub manifest: &'a Descriptor,
    /// The base image, if any: the ref (or digest) it was named by and its manifest's digest.
    pub base: Option<(&'a str, &'a Digest)>,
}

/// The SPDX 2.3 JSON bytes for an image whose new layer holds `files` (in archive order), created
/// at `created` (RFC 3339).
pub fn document(image: &Described, files: &[LayerFile], created: &str) -> Vec<u8> {
    let mut packages = vec![json!({
        "name": image.name,
        "SPDXID": "SPDXRef-Image",
        "downloadLocation": "NOASSERTION",
        "filesAnalyzed": true,
        "packageVerificationCode": {"packageVerificationCodeValue": verification_code(files)},
        "checksums": [checksum("SHA256", &image.manifest.digest.hex())],
        "primaryPackagePurpose": "CONTAINER",
        "comment": format!("the image {}; its files are those of the layer this build added", image.manifest.digest),
    })];
    let mut relationships = vec![relationship(
        "SPDXRef-DOCUMENT",
        "DESCRIBES",
        "SPDXRef-Image",
    )];
    if let Some((name, digest)) = image.base {
        packages.push(json!({
            "name": name,
            "SPDXID": "SPDXRef-Base",
            "downloadLocation": "NOASSERTION",
            "filesAnalyzed": false,
            "checksums": [checksum("SHA256", &digest.hex())],
            "primaryPackagePurpose": "CONTAINER",
            "comment": format!("the base image {digest}"),
        }));
        relationships.push(relationship(
            "SPDXRef-Image",
            "DESCENDANT_OF",
            "SPDXRef-Base",
        ));
    }
    let mut spdx_files = Vec::with_capacity(files.len());
    for (i, f) in files.iter().enumerate() {
        let id = format!("SPDXRef-File-{}", i + 1);
        spdx_files.push(json!({
            // SPDX names files relative to the package root, as "./path". A name that is not UTF-8
            // shows its odd bytes as U+FFFD.
            "fileName": format!("./{}", String::from_utf8_lossy(&f.path)),
            "SPDXID": id,
            "checksums": [checksum("SHA1", &hex::encode(f.sha1)), checksum("SHA256", &hex::encode(f.sha256))],
            // SPDX 2.3 has no size or mode field.
            "comment": format!("size {} mode {:04o}", f.size, f.mode),
        }));
        relationships.push(relationship("SPDXRef-Image", "CONTAINS", &id));
    }
    let doc = json!({
        "spdxVersion": "SPDX-2.3",
        "dataLicense": "CC0-1.0",
        "SPDXID": "SPDXRef-DOCUMENT",
        "name": image.name,
        "documentNamespace": format!("{NAMESPACE_BASE}{}", image.manifest.digest.hex()),
        "creationInfo": {
            "created": created,
            "creators": [concat!("Tool: oci-", env!("CARGO_PKG_VERSION"))],
        },
        "packages": packages,
        "files": spdx_files,
        "relationships": relationships,
    });
    spec::to_json_bytes(&doc)
}

/// SPDX's package verification code: the SHA-1 of the files' lowercase hex SHA-1s, sorted and
/// concatenated.
pub fn verification_code(files: &[LayerFile]) -> String {
    let mut sums: Vec<String> = files.iter().map(|f| hex::encode(f.sha1)).collect();
    sums.sort_unstable();
    hex::encode(Sha1::digest(sums.concat().as_bytes()))
}

fn checksum(algorithm: &str, hex: &str) -> Value {
    json!({"algorithm": algorithm, "checksumValue": hex})
}

fn relationship(from: &str, kind: &str, to: &str) -> Value {
    json!({"spdxElementId": from, "relationshipType": kind, "relatedSpdxElement": to})
}

/// Writes the SBOM, the empty config and an artifact manifest whose subject is `image` into the
/// layout (each blob tracked by `rollback`); returns the manifest's descriptor as `index.json`
/// lists a referrer (untagged, with its `artifactType`). `index.json` itself is left to the caller.
pub fn attach(
    layout: &Layout,
    rollback: &mut Rollback,
    image: &Descriptor,
    sbom: &[u8],
    created: &str,
) -> Result<Descriptor, LayoutError> {
    let mut commit = |bytes: &[u8]| {
        let c = layout.write_blob(bytes)?;
        rollback.track(&c);
        Ok::<_, LayoutError>(c)
    };
    let blob = commit(sbom)?;
    commit(EMPTY_JSON)?;
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": spec::MEDIA_TYPE_MANIFEST,
        "artifactType": MEDIA_TYPE_SPDX,
        "config": spec::empty_config(),
        "layers": [Descriptor::new(MEDIA_TYPE_SPDX, blob.digest, blob.size)],
        "subject": Descriptor::new(&image.media_type, image.digest, image.size),
        "annotations": {ANNOTATION_CREATED: created},
    });
    let m = commit(&spec::to_json_bytes(&manifest))?;
    let mut entry = Descriptor::new(spec::MEDIA_TYPE_MANIFEST, m.digest, m.size);
    entry
        .extra
        .insert("artifactType".into(), json!(MEDIA_TYPE_SPDX));
    Ok(entry)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(path: &str, bytes: &[u8]) -> LayerFile {
        LayerFile {
            path: path.as_bytes().to_vec(),
            mode: 0o644,
            size: bytes.len() as u64,
            sha1: Sha1::digest(bytes).into(),
            sha256: sha2::Sha256::digest(bytes).into(),
        }
    }

    #[test]
    fn the_verification_code_hashes_the_sorted_sha1s() {
        // sha1("a") = 86f7e437..., sha1("b") = e9d71f5e...: sorted, concatenated, hashed again.
        let files = [file("z", b"b"), file("y", b"a")];
        let joined =
            "86f7e437faa5a7fce15d1ddcb9eaeaea377667b8e9d71f5ee7c92d6dc9e92ffdad17b8bd49418f98";
        assert_eq!(
            verification_code(&files),
            hex::encode(Sha1::digest(joined.as_bytes()))
        );
        assert_eq!(
            verification_code(&[]),
            "da39a3ee5e6b4b0d3255bfef95601890afd80709",
            "no files: the SHA-1 of nothing"
        );
    }

    #[test]
    fn files_are_listed_with_both_sums_size_and_mode() {
        let manifest = Descriptor::new(spec::MEDIA_TYPE_MANIFEST, Digest::of(b"m"), 1);
        let base = Digest::of(b"base");
        let image = Described {
            name: "app",
            manifest: &manifest,
            base: Some(("base", &base)),
        };
        let mut f = file("bin/run.sh", b"#!/bin/sh\n");
        f.mode = 0o4755;
        let doc: Value =
            serde_json::from_slice(&document(&image, &[f], "1970-01-01T00:00:00Z")).unwrap();
        let listed = &doc["files"][0];
        assert_eq!(listed["fileName"], "./bin/run.sh");
        assert_eq!(listed["comment"], "size 10 mode 4755");
        assert_eq!(listed["checksums"][0]["algorithm"], "SHA1");
        assert_eq!(
            doc["packages"][1]["checksums"][0]["checksumValue"],
            base.hex()
        );
        assert_eq!(
            doc["documentNamespace"],
            format!("https://fleet.invalid/spdx/{}", manifest.digest.hex())
        );
        let kinds: Vec<&str> = doc["relationships"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["relationshipType"].as_str().unwrap())
            .collect();
        assert_eq!(kinds, ["DESCRIBES", "DESCENDANT_OF", "CONTAINS"]);
    }
}
