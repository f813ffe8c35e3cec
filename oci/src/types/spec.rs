//! The OCI image-spec documents this crate reads and writes: media types, descriptors, platforms, indexes.
use crate::types::digest::Digest;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;

/// `application/vnd.oci.image.manifest.v1+json`
pub const MEDIA_TYPE_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
/// `application/vnd.oci.image.index.v1+json`
pub const MEDIA_TYPE_INDEX: &str = "application/vnd.oci.image.index.v1+json";
/// `application/vnd.oci.image.config.v1+json`
pub const MEDIA_TYPE_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
/// `application/vnd.oci.image.layer.v1.tar`
pub const MEDIA_TYPE_LAYER_TAR: &str = "application/vnd.oci.image.layer.v1.tar";
/// `application/vnd.oci.image.layer.v1.tar+gzip`
pub const MEDIA_TYPE_LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
/// `application/vnd.oci.image.layer.v1.tar+zstd`
pub const MEDIA_TYPE_LAYER_ZSTD: &str = "application/vnd.oci.image.layer.v1.tar+zstd";
/// Docker's schema 2 manifest, which registries still serve and this crate reads.
pub const MEDIA_TYPE_DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
/// Docker's manifest list, the counterpart of an OCI index.
pub const MEDIA_TYPE_DOCKER_LIST: &str =
    "application/vnd.docker.distribution.manifest.list.v2+json";
/// The empty JSON document `{}`, the config of an artifact that has none.
pub const MEDIA_TYPE_EMPTY: &str = "application/vnd.oci.empty.v1+json";
/// The annotation that names an image in a layout's `index.json`.
pub const ANNOTATION_REF_NAME: &str = "org.opencontainers.image.ref.name";

/// Whether a media type is an image manifest (OCI or Docker).
pub fn is_manifest(media_type: &str) -> bool {
    media_type == MEDIA_TYPE_MANIFEST || media_type == MEDIA_TYPE_DOCKER_MANIFEST
}

/// Whether a media type is an index of manifests (OCI index or Docker manifest list).
pub fn is_index(media_type: &str) -> bool {
    media_type == MEDIA_TYPE_INDEX || media_type == MEDIA_TYPE_DOCKER_LIST
}

/// A content descriptor: what a blob is, its digest and its size. Unknown fields are kept.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Descriptor {
    /// The blob's media type.
    pub media_type: String,
    /// The blob's digest.
    pub digest: Digest,
    /// The blob's size in bytes.
    pub size: u64,
    /// The platform of the manifest it points at, in an index.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<Platform>,
    /// Annotations (sorted by key, so they serialize the same every time).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    /// Fields this crate does not interpret (`urls`, `artifactType`...), kept as they were.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl Descriptor {
    /// A descriptor with no platform, annotations or extra fields.
    pub fn new(media_type: &str, digest: Digest, size: u64) -> Descriptor {
        Descriptor {
            media_type: media_type.to_string(),
            digest,
            size,
            platform: None,
            annotations: BTreeMap::new(),
            extra: serde_json::Map::new(),
        }
    }

    /// The `org.opencontainers.image.ref.name` annotation, if any.
    pub fn ref_name(&self) -> Option<&str> {
        self.annotations
            .get(ANNOTATION_REF_NAME)
            .map(String::as_str)
    }
}

/// An operating system and CPU architecture, as in `linux/arm64/v8`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Platform {
    /// The CPU architecture, in Go's names (`amd64`, `arm64`...).
    pub architecture: String,
    /// The operating system, in Go's names (`linux`...).
    pub os: String,
    /// The operating system version, for Windows images.
    #[serde(
        rename = "os.version",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub os_version: Option<String>,
    /// Required OS features.
    #[serde(
        rename = "os.features",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub os_features: Option<Vec<String>>,
    /// The CPU variant (`v7`, `v8`...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub variant: Option<String>,
}

/// Why a platform string was refused.
#[derive(Debug, thiserror::Error)]
#[error(
    "bad platform {0:?}: expected OS/ARCH[/VARIANT] with a known OS and architecture, such as linux/amd64 or linux/arm64/v8"
)]
pub struct PlatformError(pub String);

const KNOWN_OS: &[&str] = &[
    "aix",
    "android",
    "darwin",
    "dragonfly",
    "freebsd",
    "illumos",
    "ios",
    "js",
    "linux",
    "netbsd",
    "openbsd",
    "plan9",
    "solaris",
    "wasip1",
    "windows",
];
const KNOWN_ARCH: &[&str] = &[
    "386", "amd64", "arm", "arm64", "loong64", "mips", "mips64", "mips64le", "mipsle", "ppc64",
    "ppc64le", "riscv64", "s390x", "wasm",
];

impl Platform {
    /// Parses `OS/ARCH[/VARIANT]` with Go's OS and architecture names.
    pub fn parse(s: &str) -> Result<Platform, PlatformError> {
        let bad = || PlatformError(s.to_string());
        let parts: Vec<&str> = s.split('/').collect();
        let (os, arch, variant) = match parts.as_slice() {
            [os, arch] => (*os, *arch, None),
            [os, arch, v] => (*os, *arch, Some(*v)),
            _ => return Err(bad()),
        };
        if !KNOWN_OS.contains(&os) || !KNOWN_ARCH.contains(&arch) {
            return Err(bad());
        }
        if let Some(v) = variant
            && (v.is_empty()
                || !v
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()))
        {
            return Err(bad());
        }
        Ok(Platform {
            architecture: arch.to_string(),
            os: os.to_string(),
            os_version: None,
            os_features: None,
            variant: variant.map(str::to_string),
        })
    }
}

impl fmt::Display for Platform {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.os, self.architecture)?;
        if let Some(v) = &self.variant {
            write!(f, "/{v}")?;
        }
        Ok(())
    }
}

/// An image index: a layout's `index.json`, or a multi-platform image.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Index {
    /// Always 2.
    pub schema_version: u32,
    /// `application/vnd.oci.image.index.v1+json` (optional in older documents).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub media_type: Option<String>,
    /// The manifests (or indexes) it points at.
    pub manifests: Vec<Descriptor>,
    /// Annotations on the index itself.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    /// Fields this crate does not interpret, kept as they were.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl Index {
    /// An empty OCI index.
    pub fn empty() -> Index {
        Index {
            schema_version: 2,
            media_type: Some(MEDIA_TYPE_INDEX.to_string()),
            manifests: Vec::new(),
            annotations: BTreeMap::new(),
            extra: serde_json::Map::new(),
        }
    }
}

/// The bytes of a JSON document as this crate stores it: compact, fields in declaration order.
pub fn to_json_bytes<T: Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec(value)
        // Cannot fail: documents of plain strings, numbers and maps always serialize.
        .expect("documents of plain strings, numbers and maps always serialize")
}

/// The empty JSON object, the config of an artifact that has none.
pub const EMPTY_JSON: &[u8] = b"{}";

/// The descriptor of the empty config `{}`, with its data inline as the image spec suggests.
pub fn empty_config() -> serde_json::Value {
    let mut d = Descriptor::new(
        MEDIA_TYPE_EMPTY,
        Digest::of(EMPTY_JSON),
        EMPTY_JSON.len() as u64,
    );
    d.extra
        .insert("data".into(), serde_json::Value::String("e30=".into()));
    serde_json::to_value(d).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_platforms_with_and_without_variant() {
        assert_eq!(
            Platform::parse("linux/amd64").unwrap().to_string(),
            "linux/amd64"
        );
        let p = Platform::parse("linux/arm64/v8").unwrap();
        assert_eq!(
            (p.os.as_str(), p.architecture.as_str(), p.variant.as_deref()),
            ("linux", "arm64", Some("v8"))
        );
        for bad in [
            "linux",
            "linux/",
            "linux/x86_64",
            "plan10/amd64",
            "linux/arm64/V8",
            "linux/arm/v7/x",
        ] {
            assert!(Platform::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn descriptors_keep_unknown_fields() {
        let json = r#"{"mediaType":"m","digest":"sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855","size":0,"urls":["u"]}"#;
        let d: Descriptor = serde_json::from_str(json).unwrap();
        assert_eq!(String::from_utf8(to_json_bytes(&d)).unwrap(), json);
    }
}
