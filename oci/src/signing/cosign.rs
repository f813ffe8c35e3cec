//! Key-pair signatures in cosign's format. The payload is cosign's simple-signing JSON naming the
//! image's digest; the signature (ECDSA P-256 over SHA-256, ASN.1 DER, base64) sits in the layer's
//! `dev.cosignproject.cosign/signature` annotation; the manifest lives under the tag
//! `sha256-<hex>.sig`, where `cosign verify --key` looks, and, where the registry has the referrers
//! API, also as a referrer of the image (cosign's OCI 1.1 form).
use crate::signing::keys::{PublicKey, SigningKey};
use crate::transfer::carry::{self, Staging};
use crate::transfer::endpoint::{CopyError, Endpoint};
use crate::transfer::push::BlobOptions;
use crate::transfer::referrers::{self, ArtifactManifest, Link, Referrer};
use crate::types::digest::Digest;
use crate::types::spec::{self, Descriptor};
use base64::Engine as _;

/// The media type of cosign's payload layer.
pub const SIMPLESIGNING: &str = "application/vnd.dev.cosign.simplesigning.v1+json";
/// The layer annotation that holds the base64 signature.
pub const SIGNATURE_ANNOTATION: &str = "dev.cosignproject.cosign/signature";
/// The artifact type of a signature stored as a referrer.
pub const SIGNATURE_ARTIFACT_TYPE: &str = "application/vnd.dev.cosign.artifact.sig.v1+json";
/// The payload's `critical.type`.
const PAYLOAD_TYPE: &str = "cosign container image signature";
/// The most bytes read for one payload.
const PAYLOAD_LIMIT: u64 = 64 << 10;
/// The empty JSON document, the config of an artifact that has none.

#[derive(Debug, thiserror::Error)]
pub enum SignatureError {
    #[error(transparent)]
    Copy(#[from] CopyError),
    #[error(
        "{image} has no signature (no tag sha256-HEX.sig and no signature referrer): sign it with oci sign --key KEY"
    )]
    Unsigned { image: String },
    #[error("{image} has no valid signature by {keys}: {reasons}")]
    NoneValid {
        image: String,
        keys: String,
        reasons: String,
    },
}

/// A signature made.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Signed {
    pub image: Digest,
    pub key: String,
    /// The manifest now under `sha256-<hex>.sig`.
    pub signatures: Digest,
    /// The signature as a referrer, where the registry has the referrers API.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub referrer: Option<Digest>,
}

/// A signature that checked out.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Verified {
    pub image: Digest,
    /// The key that made it (`sha256:` of its DER).
    pub key: String,
    /// The payload layer's digest.
    pub payload: Digest,
    /// Where it was found: the tag, or the referrer's digest.
    pub found_in: String,
}

/// cosign's simple-signing payload for `digest` in the repository `docker_reference`, with
/// cosign's field order (Go's struct order) so the bytes are the ones cosign would sign.
pub fn payload(docker_reference: &str, digest: &Digest) -> Vec<u8> {
    let quote = |s: &str| serde_json::Value::String(s.to_string()).to_string();
    format!(
        r#"{{"critical":{{"identity":{{"docker-reference":{}}},"image":{{"docker-manifest-digest":{}}},"type":{}}},"optional":null}}"#,
        quote(docker_reference),
        quote(&digest.to_string()),
        quote(PAYLOAD_TYPE)
    )
    .into_bytes()
}

/// Why a signature's payload is not a cosign payload, in one line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct PayloadError(String);

/// The image digest a payload signs, or why it is not a cosign payload.
pub fn signed_digest(payload: &[u8]) -> Result<Digest, PayloadError> {
    signed_digest_line(payload).map_err(PayloadError)
}

fn signed_digest_line(payload: &[u8]) -> Result<Digest, String> {
    let v: serde_json::Value =
        serde_json::from_slice(payload).map_err(|e| format!("its payload is not JSON ({e})"))?;
    let critical = v.get("critical").ok_or("its payload has no critical")?;
    if critical.get("type").and_then(|t| t.as_str()) != Some(PAYLOAD_TYPE) {
        return Err(format!(
            "its payload's critical.type is not {PAYLOAD_TYPE:?}"
        ));
    }
    critical
        .pointer("/image/docker-manifest-digest")
        .and_then(|d| d.as_str())
        .and_then(|d| d.parse().ok())
        .ok_or_else(|| "its payload names no docker-manifest-digest".to_string())
}

/// How the image's repository is named in the payload: `HOST/REPO`, as cosign writes it.
fn docker_reference(ep: &Endpoint) -> String {
    match ep {
        Endpoint::Registry { reference, .. } => format!("{}/{}", reference.host, reference.repo),
        Endpoint::Layout { name, .. } => name.clone(),
    }
}

/// Signs the image `ep` names and stores the signature where cosign stores it.
pub async fn sign(
    ep: &Endpoint,
    key: &SigningKey,
    blob_options: &BlobOptions,
) -> Result<Signed, SignatureError> {
    let image = ep.top_manifest().await?;
    let payload = payload(&docker_reference(ep), &image.digest);
    let signature = base64::engine::general_purpose::STANDARD.encode(key.sign(&payload));
    let mut layer = Descriptor::new(SIMPLESIGNING, Digest::of(&payload), payload.len() as u64);
    layer
        .annotations
        .insert(SIGNATURE_ANNOTATION.into(), signature);
    // cosign's signature image config: one diff_id per layer (the payload, uncompressed).
    let config = serde_json::json!({
        "architecture": "",
        "created": "0001-01-01T00:00:00Z",
        "history": [{"created": "0001-01-01T00:00:00Z"}],
        "os": "",
        "rootfs": {"type": "layers", "diff_ids": [layer.digest.to_string()]},
        "config": {}
    });
    let config = spec::to_json_bytes(&config);
    let doc = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": spec::MEDIA_TYPE_MANIFEST,
        "config": Descriptor::new(spec::MEDIA_TYPE_CONFIG, Digest::of(&config), config.len() as u64),
        "layers": [layer],
    });
    let tagged = referrers::referrer(
        &image,
        spec::to_json_bytes(&doc),
        Link::Tag(referrers::cosign_tag(&image.digest, "sig")),
        SIMPLESIGNING,
    );
    let mut staging = Staging::new()?;
    staging.add(&config)?;
    staging.add(&payload)?;
    let signatures = carry::publish(ep, &tagged, &staging, blob_options).await?;
    let mut signed = Signed {
        image: image.digest,
        key: key.public().id(),
        signatures,
        referrer: None,
    };
    if referrers::has_api(ep, &image.digest).await? {
        let doc = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": spec::MEDIA_TYPE_MANIFEST,
            "artifactType": SIGNATURE_ARTIFACT_TYPE,
            "config": spec::empty_config(),
            "layers": [layer],
            "subject": Descriptor::new(&image.media_type, image.digest, image.bytes.len() as u64),
        });
        let r = referrers::referrer(
            &image,
            spec::to_json_bytes(&doc),
            Link::Subject,
            SIGNATURE_ARTIFACT_TYPE,
        );
        staging.add(spec::EMPTY_JSON)?;
        signed.referrer = Some(carry::publish(ep, &r, &staging, blob_options).await?);
    }
    Ok(signed)
}

/// Checks that the image `ep` names carries a valid signature by one of `keys`.
pub async fn verify(ep: &Endpoint, keys: &[PublicKey]) -> Result<Verified, SignatureError> {
    let image = ep.top_manifest().await?.digest;
    let found = referrers::discover(ep, &[image], None).await?;
    let signatures: Vec<&Referrer> = found
        .referrers
        .iter()
        .filter(|r| r.depth == 0)
        .filter(|r| match &r.link {
            Link::Tag(t) => t.ends_with(".sig"),
            Link::Subject => r.artifact_type == SIGNATURE_ARTIFACT_TYPE,
        })
        .collect();
    if signatures.is_empty() {
        return Err(SignatureError::Unsigned { image: ep.name() });
    }
    let mut reasons = Vec::new();
    for r in signatures {
        let found_in = match &r.link {
            Link::Tag(t) => format!("tag {t}"),
            Link::Subject => format!("referrer {}", r.manifest.digest),
        };
        let layers = ArtifactManifest::parse(&r.manifest.bytes)
            .map(|m| m.layers)
            .unwrap_or_default();
        for layer in layers.iter().filter(|l| l.media_type == SIMPLESIGNING) {
            match check(ep, &image, layer, keys).await? {
                Ok(key) => {
                    return Ok(Verified {
                        image,
                        key,
                        payload: layer.digest,
                        found_in,
                    });
                }
                Err(why) => reasons.push(format!("{found_in} layer {}: {why}", layer.digest)),
            }
        }
    }
    if reasons.is_empty() {
        reasons.push(format!("no layer of media type {SIMPLESIGNING}"));
    }
    Err(SignatureError::NoneValid {
        image: ep.name(),
        keys: keys
            .iter()
            .map(PublicKey::id)
            .collect::<Vec<_>>()
            .join(", "),
        reasons: reasons.join("; "),
    })
}

/// One signature layer: the key that made it, or why it does not count.
async fn check(
    ep: &Endpoint,
    image: &Digest,
    layer: &Descriptor,
    keys: &[PublicKey],
) -> Result<Result<String, String>, CopyError> {
    let Some(b64) = layer.annotations.get(SIGNATURE_ANNOTATION) else {
        return Ok(Err(format!("it has no {SIGNATURE_ANNOTATION} annotation")));
    };
    let Ok(signature) = base64::engine::general_purpose::STANDARD.decode(b64) else {
        return Ok(Err("its signature is not base64".into()));
    };
    if !is_der_sequence(&signature) {
        return Ok(Err(format!(
            "its signature ({} bytes) is truncated or not an ASN.1 DER ECDSA signature",
            signature.len()
        )));
    }
    if layer.size > PAYLOAD_LIMIT {
        return Ok(Err(format!(
            "its payload is {} bytes, over {PAYLOAD_LIMIT}",
            layer.size
        )));
    }
    let payload = read_blob(ep, layer).await?;
    let Some(key) = keys.iter().find(|k| k.verifies(&payload, &signature)) else {
        return Ok(Err("it was made by none of these keys".into()));
    };
    match signed_digest(&payload) {
        Ok(d) if d == *image => Ok(Ok(key.id())),
        Ok(d) => Ok(Err(format!(
            "it signs {d}, not this image ({image}): a signature moved from another image"
        ))),
        Err(why) => Ok(Err(why.to_string())),
    }
}

/// Whether `sig` is one whole DER SEQUENCE (a P-256 signature is under 128 bytes: short form).
fn is_der_sequence(sig: &[u8]) -> bool {
    sig.len() >= 8 && sig[0] == 0x30 && usize::from(sig[1]) == sig.len() - 2
}

pub(crate) async fn read_blob(ep: &Endpoint, d: &Descriptor) -> Result<Vec<u8>, CopyError> {
    match ep {
        Endpoint::Registry { client, reference } => {
            Ok(client.read_blob(&reference.repo, &d.digest, d.size).await?)
        }
        Endpoint::Layout { layout, .. } => Ok(layout.read_blob(&d.digest, Some(d.size))?),
    }
}
