//! `oci verify REF --sbom`: every SPDX SBOM that refers to an image is held against the image's
//! own bytes: it must describe this image's digest, and its file list (path, SHA-256, size, mode)
//! must be exactly the regular files of the layer it was made from (the image's last layer, the
//! one `oci build` adds). The layer is streamed, decompressed and hashed; nothing is trusted
//! from the SBOM but what it claims.
use crate::local::layout::JSON_LIMIT;
use crate::local::sbom::MEDIA_TYPE_SPDX;
use crate::transfer::endpoint::{CopyError, Endpoint};
use crate::transfer::referrers::{self, ArtifactManifest};
use crate::types::digest::Digest;
use crate::types::spec::{self, Descriptor};
use futures_util::StreamExt;
use serde::Serialize;
use serde_json::Value;
use sha2::{Digest as _, Sha256};
use std::collections::{BTreeMap, HashMap};
use std::io::{self, Read, Write};

/// What one SBOM was checked against.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SbomChecked {
    /// The SBOM's artifact manifest.
    pub sbom: Digest,
    /// The layer whose files it lists.
    pub layer: Digest,
    pub files: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum SbomError {
    #[error(transparent)]
    Copy(#[from] CopyError),
    #[error(
        "{image} has no SPDX SBOM (no referrer of type {MEDIA_TYPE_SPDX}): build it with oci build --sbom or attach one"
    )]
    Missing { image: String },
    #[error(
        "{image} is an index: name one platform's manifest (oci inspect lists them) to check its SBOM"
    )]
    Index { image: String },
    #[error("{image} has no layer for an SBOM to describe")]
    NoLayer { image: String },
    #[error("the SBOM {sbom} of {image} cannot be read: {why}")]
    Unreadable {
        image: String,
        sbom: Digest,
        why: String,
    },
    #[error("the SBOM {sbom} of {image} does not match the image: {why}")]
    Mismatch {
        image: String,
        sbom: Digest,
        why: String,
    },
    #[error("cannot read the layer {layer} of {image}: {why}")]
    Layer {
        image: String,
        layer: Digest,
        why: String,
    },
}

/// A regular file as an SBOM lists it, or as the layer holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Listed {
    sha256: String,
    size: u64,
    mode: u32,
}

/// Checks every SPDX SBOM that refers to the image `ep` names; fails on the first that does not
/// describe it exactly.
pub async fn check(ep: &Endpoint) -> Result<Vec<SbomChecked>, SbomError> {
    let image = ep.top_manifest().await?;
    if spec::is_index(&image.media_type) {
        return Err(SbomError::Index { image: ep.name() });
    }
    let layer = ArtifactManifest::parse(&image.bytes)
        .and_then(|m| m.layers.last().cloned())
        .ok_or_else(|| SbomError::NoLayer { image: ep.name() })?;
    let found = referrers::discover(ep, &[image.digest], Some(MEDIA_TYPE_SPDX)).await?;
    let sboms: Vec<_> = found.referrers.iter().filter(|r| r.depth == 0).collect();
    if sboms.is_empty() {
        return Err(SbomError::Missing { image: ep.name() });
    }
    let in_layer = layer_files(ep, &layer).await?;
    let mut checked = Vec::new();
    for r in sboms {
        let sbom = r.manifest.digest;
        let unreadable = |why: String| SbomError::Unreadable {
            image: ep.name(),
            sbom,
            why,
        };
        let blob = ArtifactManifest::parse(&r.manifest.bytes)
            .and_then(|m| {
                m.layers
                    .into_iter()
                    .find(|l| l.media_type == MEDIA_TYPE_SPDX)
            })
            .ok_or_else(|| unreadable(format!("it has no layer of type {MEDIA_TYPE_SPDX}")))?;
        if blob.size > JSON_LIMIT {
            return Err(unreadable(format!(
                "it is {} bytes, over {JSON_LIMIT}",
                blob.size
            )));
        }
        let bytes = crate::signing::cosign::read_blob(ep, &blob).await?;
        let doc: Value = serde_json::from_slice(&bytes)
            .map_err(|e| unreadable(format!("it is not JSON: {e}")))?;
        let listed = sbom_files(&doc).map_err(unreadable)?;
        compare(&doc, &image.digest, &listed, &in_layer).map_err(|why| SbomError::Mismatch {
            image: ep.name(),
            sbom,
            why,
        })?;
        checked.push(SbomChecked {
            sbom,
            layer: layer.digest,
            files: listed.len(),
        });
    }
    Ok(checked)
}

/// The SBOM's files by name (`./path`), from `files[]`: SHA256 checksum and the `size N mode
/// MMMM` comment `oci build --sbom` writes (SPDX 2.3 has no field for either).
fn sbom_files(doc: &Value) -> Result<BTreeMap<String, Listed>, String> {
    if doc.get("spdxVersion").and_then(Value::as_str) != Some("SPDX-2.3") {
        return Err("its spdxVersion is not SPDX-2.3".into());
    }
    let mut files = BTreeMap::new();
    let entries = match doc.get("files") {
        None => return Ok(files),
        Some(Value::Array(a)) => a,
        Some(_) => return Err("its files is not a list".into()),
    };
    for f in entries {
        let name = f
            .get("fileName")
            .and_then(Value::as_str)
            .ok_or("a file has no fileName")?;
        let sha256 = f
            .get("checksums")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .find(|c| c.get("algorithm").and_then(Value::as_str) == Some("SHA256"))
            .and_then(|c| c.get("checksumValue").and_then(Value::as_str))
            .ok_or_else(|| format!("{name} has no SHA256 checksum"))?;
        let comment = f.get("comment").and_then(Value::as_str).unwrap_or("");
        let (size, mode) = size_and_mode(comment)
            .ok_or_else(|| format!("{name} has no \"size N mode MMMM\" comment"))?;
        let listed = Listed {
            sha256: sha256.to_ascii_lowercase(),
            size,
            mode,
        };
        if files.insert(name.to_string(), listed).is_some() {
            return Err(format!("{name} is listed twice"));
        }
    }
    Ok(files)
}

fn size_and_mode(comment: &str) -> Option<(u64, u32)> {
    let mut words = comment.split_whitespace();
    match (words.next(), words.next(), words.next(), words.next()) {
        (Some("size"), Some(size), Some("mode"), Some(mode)) => {
            Some((size.parse().ok()?, u32::from_str_radix(mode, 8).ok()?))
        }
        _ => None,
    }
}

/// Why the SBOM does not describe this image and these files, naming the first file that differs.
fn compare(
    doc: &Value,
    image: &Digest,
    listed: &BTreeMap<String, Listed>,
    in_layer: &BTreeMap<String, Listed>,
) -> Result<(), String> {
    let described = doc
        .get("packages")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(|p| p.get("SPDXID").and_then(Value::as_str) == Some("SPDXRef-Image"))
        .flat_map(|p| {
            p.get("checksums")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
        })
        .find(|c| c.get("algorithm").and_then(Value::as_str) == Some("SHA256"))
        .and_then(|c| c.get("checksumValue").and_then(Value::as_str));
    match described {
        Some(hex) if hex.eq_ignore_ascii_case(&image.hex()) => {}
        Some(hex) => {
            return Err(format!(
                "it describes the image sha256:{hex}, not this one ({image})"
            ));
        }
        None => return Err("it names no image (no SPDXRef-Image package with a SHA256)".into()),
    }
    let mut differences = Vec::new();
    for (name, l) in in_layer {
        match listed.get(name) {
            None => differences.push(format!("{name} is in the layer but not in the SBOM")),
            Some(s) if s.sha256 != l.sha256 => differences.push(format!(
                "{name} has SHA-256 {} in the SBOM but {} in the layer",
                s.sha256, l.sha256
            )),
            Some(s) if s.size != l.size => differences.push(format!(
                "{name} has size {} in the SBOM but {} in the layer",
                s.size, l.size
            )),
            Some(s) if s.mode != l.mode => differences.push(format!(
                "{name} has mode {:04o} in the SBOM but {:04o} in the layer",
                s.mode, l.mode
            )),
            Some(_) => {}
        }
    }
    for name in listed.keys().filter(|n| !in_layer.contains_key(*n)) {
        differences.push(format!("{name} is in the SBOM but not in the layer"));
    }
    match differences.len() {
        0 => Ok(()),
        1 => Err(differences.remove(0)),
        n => Err(format!("{n} files differ, first: {}", differences[0])),
    }
}

/// The layer's regular files as an SBOM names them, hashed from its bytes.
async fn layer_files(
    ep: &Endpoint,
    layer: &Descriptor,
) -> Result<BTreeMap<String, Listed>, SbomError> {
    let failed = |why: String| SbomError::Layer {
        image: ep.name(),
        layer: layer.digest,
        why,
    };
    let media_type = layer.media_type.as_str();
    let Some(packing) = Packing::of(media_type) else {
        return Err(failed(format!(
            "its media type {media_type} is not a tar layer"
        )));
    };
    let reader: Box<dyn Read> = match ep {
        Endpoint::Layout { layout, .. } => Box::new(
            layout
                .open_blob(&layer.digest, Some(layer.size))
                .map_err(|e| failed(e.to_string()))?,
        ),
        // A registry's layer is streamed (verified against its digest) into a file first.
        Endpoint::Registry { client, reference } => {
            let verdict = crate::transfer::remote::verify::Verdict::default();
            let mut stream = client
                .get_blob(&reference.repo, &layer.digest, layer.size, verdict.clone())
                .await
                .map_err(CopyError::from)?;
            let mut file = tempfile::tempfile().map_err(|e| failed(e.to_string()))?;
            while let Some(chunk) = stream.next().await {
                let chunk = chunk.map_err(|e| match verdict.mismatch() {
                    Some(m) => failed(m.to_string()),
                    None => failed(e.to_string()),
                })?;
                file.write_all(&chunk).map_err(|e| failed(e.to_string()))?;
            }
            use std::io::Seek;
            file.rewind().map_err(|e| failed(e.to_string()))?;
            Box::new(io::BufReader::with_capacity(1 << 20, file))
        }
    };
    let tar = packing.unpack(reader).map_err(|e| failed(e.to_string()))?;
    list_tar(tar).map_err(|e| failed(e.to_string()))
}

/// How a layer's tar is packed, by its media type (OCI's and Docker's).
#[derive(Debug, Clone, Copy)]
enum Packing {
    Tar,
    Gzip,
    Zstd,
}

impl Packing {
    fn of(media_type: &str) -> Option<Packing> {
        match media_type {
            spec::MEDIA_TYPE_LAYER_TAR | "application/vnd.docker.image.rootfs.diff.tar" => {
                Some(Packing::Tar)
            }
            spec::MEDIA_TYPE_LAYER_GZIP | "application/vnd.docker.image.rootfs.diff.tar.gzip" => {
                Some(Packing::Gzip)
            }
            spec::MEDIA_TYPE_LAYER_ZSTD => Some(Packing::Zstd),
            _ => None,
        }
    }

    fn unpack(self, packed: Box<dyn Read>) -> io::Result<Box<dyn Read>> {
        Ok(match self {
            Packing::Tar => packed,
            Packing::Gzip => Box::new(flate2::read::MultiGzDecoder::new(packed)),
            Packing::Zstd => Box::new(zstd::stream::read::Decoder::new(packed)?),
        })
    }
}

/// The regular files of a tar (a hardlink is listed as its target's content under its own name
/// and mode), named `./path` as SPDX names them.
fn list_tar(reader: impl Read) -> io::Result<BTreeMap<String, Listed>> {
    let mut files = BTreeMap::new();
    let mut by_path: HashMap<Vec<u8>, (String, u64)> = HashMap::new();
    let mut archive = ::tar::Archive::new(reader);
    let mut buf = vec![0; 64 * 1024];
    for entry in archive.entries()? {
        let mut entry = entry?;
        let path = entry.path_bytes().into_owned();
        let mode = entry.header().mode()? & 0o7777;
        let kind = entry.header().entry_type();
        let (sha256, size) = if kind.is_file() {
            let mut hash = Sha256::new();
            let mut size = 0u64;
            loop {
                let n = entry.read(&mut buf)?;
                if n == 0 {
                    break;
                }
                size += n as u64;
                hash.update(&buf[..n]);
            }
            (hex::encode(hash.finalize()), size)
        } else if kind.is_hard_link() {
            let target = entry.link_name_bytes().unwrap_or_default().into_owned();
            match by_path.get(&target) {
                Some(known) => known.clone(),
                None => continue,
            }
        } else {
            continue;
        };
        by_path.insert(path.clone(), (sha256.clone(), size));
        let name = format!("./{}", String::from_utf8_lossy(&path));
        files.insert(name, Listed { sha256, size, mode });
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_comment_oci_build_writes() {
        assert_eq!(size_and_mode("size 12 mode 0644"), Some((12, 0o644)));
        assert_eq!(size_and_mode("size 12"), None);
        assert_eq!(size_and_mode("size x mode 0644"), None);
    }
}
