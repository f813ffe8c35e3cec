//! Signed releases of the machine's binaries. A release is a manifest (version, a sequence that
//! only grows, an expiry, the lowest sequence a machine may ever go back to, and the SHA-256 and
//! size of each binary for each target) signed with Ed25519 by a release key, whose certificate
//! is signed by one of the fleet's root keys. A release key is rotated by certifying another
//! under the same root; no agent changes. Both signatures are over a context string and the
//! exact bytes, so a certificate can never pass for a manifest.
//!
//! [`verify`] is the one check the coordinator (`release add`) and the agent make; each refusal is
//! a [`ReleaseRefusal`] that names what was wrong in one line.
use crate::pin::PinnedKey;
use base64::Engine;
use fleet_vocab::Digest;
use ring::signature::{ED25519, Ed25519KeyPair, KeyPair, UnparsedPublicKey};
use serde::{Deserialize, Serialize};

const MANIFEST_CONTEXT: &[u8] = b"fleet release manifest v1\n";
const CERTIFICATE_CONTEXT: &[u8] = b"fleet release key certificate v1\n";
/// PKCS#8 v1 of an Ed25519 private key, up to its 32-byte seed (RFC 8410, section 7).
const RFC8410_PREFIX: &[u8] = &[
    0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04, 0x20,
];
const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

/// What a release carries, signed as the exact bytes it was written in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReleaseManifest {
    pub version: String,
    /// Grows with every release; a machine never installs one at or below what it runs.
    pub sequence: u64,
    /// The lowest sequence a machine that installs this release may ever go back to.
    pub min_sequence: u64,
    /// Past this time (Unix ms) the manifest is refused: a stale release cannot be replayed.
    pub expires_at_ms: u64,
    pub binaries: Vec<ReleaseBinary>,
    /// The fleet's roots from this release on, when it rotates them: signed under a root trusted
    /// now, so a machine learns the new roots from the old. Empty: the roots stay.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub roots: Vec<PinnedKey>,
    /// Release keys never to be trusted again, whatever root certified them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub revoked_keys: Vec<PinnedKey>,
}

/// What a checker trusts: the fleet's roots, and the release keys revoked under them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReleaseTrust {
    pub roots: Vec<PinnedKey>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub revoked: Vec<PinnedKey>,
}

impl ReleaseTrust {
    pub fn of_roots(roots: Vec<PinnedKey>) -> ReleaseTrust {
        ReleaseTrust {
            roots,
            revoked: Vec::new(),
        }
    }

    /// The trust once `manifest` (verified under this one) is taken: its roots in place of these
    /// when it names any, and its revoked keys added to these (a revocation is never undone).
    pub fn after(&self, manifest: &ReleaseManifest) -> ReleaseTrust {
        let mut revoked = self.revoked.clone();
        for key in &manifest.revoked_keys {
            if !revoked.contains(key) {
                revoked.push(key.clone());
            }
        }
        ReleaseTrust {
            roots: match manifest.roots.is_empty() {
                true => self.roots.clone(),
                false => manifest.roots.clone(),
            },
            revoked,
        }
    }
}

/// One binary of a release, for one target.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReleaseBinary {
    /// Rust's target triple, `x86_64-unknown-linux-musl`.
    pub target: String,
    /// `fleet-agent`, `fleet-run-supervisor`.
    pub name: String,
    pub sha256: Digest,
    pub size: u64,
}

/// A root key's statement that `key` signs releases.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyCertificate {
    pub key: PinnedKey,
    pub root: PinnedKey,
    /// A name for people (`release-2026`); it plays no part in the check.
    pub name: String,
}

/// A release key's certificate as its file holds it: the certificate's exact bytes (base64) and
/// the root's signature over them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CertifiedKey {
    pub certificate: String,
    pub certificate_signature: String,
}

impl CertifiedKey {
    /// The certificate read without any check: which key and root it names.
    pub fn read(&self) -> Result<KeyCertificate, ReleaseRefusal> {
        let bytes = B64.decode(&self.certificate).map_err(|e| {
            ReleaseRefusal::Malformed(format!("the certificate is not base64: {e}"))
        })?;
        serde_json::from_slice(&bytes)
            .map_err(|e| ReleaseRefusal::Malformed(format!("the certificate: {e}")))
    }
}

/// The signature file beside a manifest (`release.sig`): the release key's certificate and the
/// release key's signature over the manifest's exact bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReleaseSignature {
    #[serde(flatten)]
    pub certified: CertifiedKey,
    pub signature: String,
}

/// A release as the coordinator hands it on: the manifest's exact bytes and its signature, which
/// the receiver checks itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReleaseOffer {
    /// In base64.
    pub manifest: String,
    pub signature: ReleaseSignature,
}

impl ReleaseOffer {
    /// The manifest read without any check: for a simulated node, never for installing.
    pub fn read_unchecked(&self) -> Result<ReleaseManifest, ReleaseRefusal> {
        let bytes = B64
            .decode(&self.manifest)
            .map_err(|e| ReleaseRefusal::Malformed(format!("the manifest is not base64: {e}")))?;
        serde_json::from_slice(&bytes)
            .map_err(|e| ReleaseRefusal::Malformed(format!("the manifest: {e}")))
    }

    /// Checks it as [`verify`] does, and answers the manifest.
    pub fn verify(
        &self,
        trust: &ReleaseTrust,
        now_ms: u64,
    ) -> Result<ReleaseManifest, ReleaseRefusal> {
        let bytes = B64
            .decode(&self.manifest)
            .map_err(|e| ReleaseRefusal::Malformed(format!("the manifest is not base64: {e}")))?;
        verify(&bytes, &self.signature, trust, now_ms)
    }

    /// The release key that signed it, as its certificate names it.
    pub fn signed_by(&self) -> Result<PinnedKey, ReleaseRefusal> {
        Ok(self.signature.certified.read()?.key)
    }
}

/// What a node reports of its releases in its facts: what it runs, and how its last update went.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReleaseFacts {
    /// The sequence of the release it runs (0: the one its bootstrap installed).
    pub sequence: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub update: Option<UpdateOutcome>,
}

/// How a node's last update went.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum UpdateOutcome {
    /// Restarted into `to`, which has not yet held a session and passed its self-check.
    Trial { from: u64, to: u64 },
    /// `to` passed its trial and runs.
    Kept { from: u64, to: u64 },
    /// `to` failed its trial, `from` was restored; `to` is never tried again here.
    Reverted { from: u64, to: u64, reason: String },
    /// The release was refused before anything was installed.
    Refused { sequence: u64, reason: String },
}

impl std::fmt::Display for UpdateOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            UpdateOutcome::Trial { to, .. } => write!(f, "trial of {to}"),
            UpdateOutcome::Kept { to, .. } => write!(f, "updated to {to}"),
            UpdateOutcome::Reverted { reason, .. } => write!(f, "reverted: {reason}"),
            UpdateOutcome::Refused { sequence, reason } => {
                write!(f, "refused {sequence}: {reason}")
            }
        }
    }
}

/// Why a release is not installed, in one line each.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReleaseRefusal {
    #[error("the release is malformed: {0}")]
    Malformed(String),
    #[error(
        "the release key is certified by {root}, which is not a root of this fleet (it trusts {trusted})"
    )]
    UnknownRoot { root: PinnedKey, trusted: String },
    #[error("the release key's certificate does not verify under the root {root}")]
    BadCertificate { root: PinnedKey },
    #[error("the manifest's signature does not verify under the release key {key}")]
    BadSignature { key: PinnedKey },
    #[error(
        "the release key {key} is revoked: sign the release with a key the fleet's root certified since"
    )]
    RevokedKey { key: PinnedKey },
    #[error(
        "the manifest expired at {expired_at_ms} ms since the epoch (now {now_ms}): sign it again"
    )]
    Expired { expired_at_ms: u64, now_ms: u64 },
    #[error(
        "the release's sequence {offered} is not above {installed}, the lowest this machine may take: a downgrade is refused"
    )]
    Downgrade { offered: u64, installed: u64 },
    #[error("the release has no {name} for {target}")]
    OtherTarget { name: String, target: String },
    #[error("{0}")]
    BinaryMismatch(Box<BinaryMismatch>),
}

/// A fetched binary that is not the one signed for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{name} for {target} does not match the manifest: it is {got} ({got_size} bytes), the manifest says {want} ({want_size} bytes)"
)]
pub struct BinaryMismatch {
    pub name: String,
    pub target: String,
    pub want: Digest,
    pub want_size: u64,
    pub got: Digest,
    pub got_size: u64,
}

/// An Ed25519 key that signs: a fleet root, or a release key.
/// Why a release signing key cannot be made or read, in one line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct SigningKeyError(String);

pub struct SigningKey(Ed25519KeyPair);

impl SigningKey {
    /// A new key and its key file's text: PKCS#8 PEM in RFC 8410's form, the one `openssl
    /// genpkey -algorithm ed25519` writes and reads (ring's own form adds the public key, which
    /// OpenSSL does not read).
    pub fn generate() -> Result<(SigningKey, String), SigningKeyError> {
        Self::generate_line().map_err(SigningKeyError)
    }

    fn generate_line() -> Result<(SigningKey, String), String> {
        let rng = ring::rand::SystemRandom::new();
        let ring_form = Ed25519KeyPair::generate_pkcs8(&rng).map_err(|e| e.to_string())?;
        // ring's document: its 16-byte header, the 32-byte seed, then the public key.
        let seed = &ring_form.as_ref()[16..48];
        let der = [RFC8410_PREFIX, seed].concat();
        let key = SigningKey::from_pkcs8(&der)?;
        Ok((key, pem("PRIVATE KEY", &der)))
    }

    /// From a key file's text: PKCS#8 PEM.
    pub fn from_pem(text: &str) -> Result<SigningKey, SigningKeyError> {
        Self::from_pem_line(text).map_err(SigningKeyError)
    }

    fn from_pem_line(text: &str) -> Result<SigningKey, String> {
        let body: String = (text.lines())
            .filter(|l| !l.starts_with("-----"))
            .collect::<Vec<_>>()
            .concat();
        let der = B64
            .decode(body.trim())
            .map_err(|e| format!("not a PEM private key ({e})"))?;
        SigningKey::from_pkcs8(&der)
    }

    fn from_pkcs8(der: &[u8]) -> Result<SigningKey, String> {
        Ed25519KeyPair::from_pkcs8_maybe_unchecked(der)
            .map(SigningKey)
            .map_err(|e| format!("not an Ed25519 PKCS#8 key ({e})"))
    }

    pub fn public(&self) -> PinnedKey {
        // Cannot fail: an Ed25519 public key is 32 bytes.
        PinnedKey::parse(&crate::pin::key_text(self.0.public_key().as_ref()))
            .expect("an Ed25519 public key is 32 bytes")
    }

    fn sign(&self, context: &[u8], bytes: &[u8]) -> String {
        B64.encode(self.0.sign(&[context, bytes].concat()).as_ref())
    }

    /// As a root: certifies `key` as a release key, named `name`.
    pub fn certify(&self, key: &PinnedKey, name: &str) -> CertifiedKey {
        let certificate = KeyCertificate {
            key: key.clone(),
            root: self.public(),
            name: name.to_string(),
        };
        // Cannot fail: plain data with string keys.
        let bytes = serde_json::to_vec(&certificate).expect("a certificate serializes");
        CertifiedKey {
            certificate: B64.encode(&bytes),
            certificate_signature: self.sign(CERTIFICATE_CONTEXT, &bytes),
        }
    }

    /// As a release key with its certificate: signs a manifest's exact bytes.
    pub fn sign_manifest(&self, manifest: &[u8], certified: &CertifiedKey) -> ReleaseSignature {
        ReleaseSignature {
            certified: certified.clone(),
            signature: self.sign(MANIFEST_CONTEXT, manifest),
        }
    }
}

fn pem(label: &str, der: &[u8]) -> String {
    let b64 = B64.encode(der);
    let lines: Vec<&str> = (b64.as_bytes().chunks(64))
        .map(|c| std::str::from_utf8(c).expect("base64 is ASCII"))
        .collect();
    format!(
        "-----BEGIN {label}-----\n{}\n-----END {label}-----\n",
        lines.join("\n")
    )
}

fn verifies(key: &PinnedKey, context: &[u8], bytes: &[u8], signature: &str) -> bool {
    let Ok(signature) = B64.decode(signature) else {
        return false;
    };
    UnparsedPublicKey::new(&ED25519, key.as_bytes())
        .verify(&[context, bytes].concat(), &signature)
        .is_ok()
}

/// Checks a manifest's chain (a trusted root certified the release key, which signed these exact
/// bytes) and its expiry; answers the manifest it read.
pub fn verify(
    manifest: &[u8],
    signature: &ReleaseSignature,
    trust: &ReleaseTrust,
    now_ms: u64,
) -> Result<ReleaseManifest, ReleaseRefusal> {
    let malformed =
        |what: &str, e: &dyn std::fmt::Display| ReleaseRefusal::Malformed(format!("{what}: {e}"));
    let certificate_bytes = B64
        .decode(&signature.certified.certificate)
        .map_err(|e| malformed("the certificate is not base64", &e))?;
    let certificate: KeyCertificate =
        serde_json::from_slice(&certificate_bytes).map_err(|e| malformed("the certificate", &e))?;
    if !trust.roots.contains(&certificate.root) {
        let trusted: Vec<String> = trust.roots.iter().map(|r| r.to_string()).collect();
        return Err(ReleaseRefusal::UnknownRoot {
            root: certificate.root,
            trusted: match trusted.is_empty() {
                true => "no root".into(),
                false => trusted.join(", "),
            },
        });
    }
    let certified = verifies(
        &certificate.root,
        CERTIFICATE_CONTEXT,
        &certificate_bytes,
        &signature.certified.certificate_signature,
    );
    if !certified {
        return Err(ReleaseRefusal::BadCertificate {
            root: certificate.root,
        });
    }
    if trust.revoked.contains(&certificate.key) {
        return Err(ReleaseRefusal::RevokedKey {
            key: certificate.key,
        });
    }
    if !verifies(
        &certificate.key,
        MANIFEST_CONTEXT,
        manifest,
        &signature.signature,
    ) {
        return Err(ReleaseRefusal::BadSignature {
            key: certificate.key,
        });
    }
    let read: ReleaseManifest =
        serde_json::from_slice(manifest).map_err(|e| malformed("the manifest", &e))?;
    if now_ms >= read.expires_at_ms {
        return Err(ReleaseRefusal::Expired {
            expired_at_ms: read.expires_at_ms,
            now_ms,
        });
    }
    if read.min_sequence > read.sequence {
        return Err(ReleaseRefusal::Malformed(format!(
            "its lowest sequence to go back to, {}, is above its own, {}",
            read.min_sequence, read.sequence
        )));
    }
    if read.revoked_keys.contains(&certificate.key) {
        return Err(ReleaseRefusal::Malformed(format!(
            "it revokes {}, the key that signed it",
            certificate.key
        )));
    }
    Ok(read)
}

impl ReleaseManifest {
    /// What a machine running `floor` (the sequence it runs, or the lowest it may go back to,
    /// whichever is higher) takes of this release for `target`: the binary `name`.
    pub fn binary_for(
        &self,
        name: &str,
        target: &str,
        floor: u64,
    ) -> Result<&ReleaseBinary, ReleaseRefusal> {
        if self.sequence <= floor {
            return Err(ReleaseRefusal::Downgrade {
                offered: self.sequence,
                installed: floor,
            });
        }
        (self.binaries.iter())
            .find(|b| b.name == name && b.target == target)
            .ok_or_else(|| ReleaseRefusal::OtherTarget {
                name: name.to_string(),
                target: target.to_string(),
            })
    }
}

impl ReleaseBinary {
    /// The bytes fetched for this binary are the ones signed for.
    pub fn check(&self, got: &Digest, got_size: u64) -> Result<(), ReleaseRefusal> {
        if *got == self.sha256 && got_size == self.size {
            return Ok(());
        }
        Err(ReleaseRefusal::BinaryMismatch(Box::new(BinaryMismatch {
            name: self.name.clone(),
            target: self.target.clone(),
            want: self.sha256,
            want_size: self.size,
            got: *got,
            got_size,
        })))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 1_800_000_000_000;
    const TARGET: &str = "x86_64-unknown-linux-musl";

    fn digest(byte: &str) -> Digest {
        format!("sha256:{}", byte.repeat(32)).parse().unwrap()
    }

    fn manifest(sequence: u64) -> Vec<u8> {
        manifest_trusting(sequence, vec![], vec![])
    }

    fn manifest_trusting(
        sequence: u64,
        roots: Vec<PinnedKey>,
        revoked_keys: Vec<PinnedKey>,
    ) -> Vec<u8> {
        serde_json::to_vec(&ReleaseManifest {
            version: "0.2.0".into(),
            sequence,
            min_sequence: sequence - 1,
            expires_at_ms: NOW + 1000,
            binaries: vec![ReleaseBinary {
                target: TARGET.into(),
                name: "fleet-agent".into(),
                sha256: digest("ab"),
                size: 7,
            }],
            roots,
            revoked_keys,
        })
        .unwrap()
    }

    struct Keys {
        root: SigningKey,
        release: SigningKey,
    }

    fn keys() -> Keys {
        Keys {
            root: SigningKey::generate().unwrap().0,
            release: SigningKey::generate().unwrap().0,
        }
    }

    fn signed(keys: &Keys, manifest: &[u8]) -> ReleaseSignature {
        let certified = keys.root.certify(&keys.release.public(), "release-1");
        keys.release.sign_manifest(manifest, &certified)
    }

    #[test]
    fn a_release_signed_under_a_trusted_root_verifies_and_gives_its_binary() {
        let keys = keys();
        let bytes = manifest(5);
        let read = verify(
            &bytes,
            &signed(&keys, &bytes),
            &ReleaseTrust::of_roots(vec![keys.root.public()]),
            NOW,
        )
        .unwrap();
        let binary = read.binary_for("fleet-agent", TARGET, 4).unwrap();
        binary.check(&digest("ab"), 7).unwrap();
        let refused = binary.check(&digest("cd"), 7).unwrap_err().to_string();
        assert!(refused.starts_with("fleet-agent for x86_64-unknown-linux-musl does not match the manifest: it is sha256:cdcd"), "{refused}");
    }

    #[test]
    fn a_rotated_release_key_under_the_same_root_verifies() {
        let keys = keys();
        let bytes = manifest(5);
        let rotated = Keys {
            root: keys.root,
            release: SigningKey::generate().unwrap().0,
        };
        let roots = ReleaseTrust::of_roots(vec![rotated.root.public()]);
        verify(&bytes, &signed(&rotated, &bytes), &roots, NOW).unwrap();
    }

    #[test]
    fn each_bad_release_is_refused_naming_why() {
        let keys = keys();
        let bytes = manifest(5);
        let good = signed(&keys, &bytes);
        let roots = ReleaseTrust::of_roots(vec![keys.root.public()]);
        // Signed under a root this fleet does not trust.
        let stranger = keys_with_root(SigningKey::generate().unwrap().0);
        let refused = verify(&bytes, &signed(&stranger, &bytes), &roots, NOW).unwrap_err();
        assert!(
            matches!(refused, ReleaseRefusal::UnknownRoot { .. }),
            "{refused}"
        );
        assert!(
            refused
                .to_string()
                .contains("which is not a root of this fleet (it trusts ed25519:")
        );
        // A manifest changed after signing.
        let mut changed = bytes.clone();
        changed[bytes.len() - 3] ^= 1;
        let refused = verify(&changed, &good, &roots, NOW).unwrap_err();
        assert!(
            matches!(refused, ReleaseRefusal::BadSignature { .. }),
            "{refused}"
        );
        // A certificate whose root signature is another's.
        let mut forged = good.clone();
        forged.certified.certificate_signature =
            signed(&stranger, &bytes).certified.certificate_signature;
        let refused = verify(&bytes, &forged, &roots, NOW).unwrap_err();
        assert!(
            matches!(refused, ReleaseRefusal::BadCertificate { .. }),
            "{refused}"
        );
        // The manifest's signature passed off as the certificate's: the contexts differ.
        let mut swapped = good.clone();
        swapped.certified.certificate_signature = good.signature.clone();
        assert!(verify(&bytes, &swapped, &roots, NOW).is_err());
        // Past its expiry.
        let refused = verify(&bytes, &good, &roots, NOW + 1000).unwrap_err();
        assert_eq!(
            refused.to_string(),
            format!(
                "the manifest expired at {} ms since the epoch (now {}): sign it again",
                NOW + 1000,
                NOW + 1000
            )
        );
        // A downgrade, and the same release again.
        let read = verify(&bytes, &good, &roots, NOW).unwrap();
        for floor in [5, 6] {
            let refused = read.binary_for("fleet-agent", TARGET, floor).unwrap_err();
            assert_eq!(
                refused,
                ReleaseRefusal::Downgrade {
                    offered: 5,
                    installed: floor
                }
            );
        }
        // Another target.
        let refused = read
            .binary_for("fleet-agent", "aarch64-unknown-linux-musl", 4)
            .unwrap_err();
        assert_eq!(
            refused.to_string(),
            "the release has no fleet-agent for aarch64-unknown-linux-musl"
        );
    }

    #[test]
    fn a_release_rotates_the_roots_and_revokes_keys_for_what_comes_after_it() {
        let old = keys();
        let new_root = SigningKey::generate().unwrap().0;
        let trust = ReleaseTrust::of_roots(vec![old.root.public()]);
        // Signed under the old root, naming the new one and revoking the old release key.
        let rotating = manifest_trusting(5, vec![new_root.public()], vec![]);
        let read = verify(&rotating, &signed(&old, &rotating), &trust, NOW).unwrap();
        let after = trust.after(&read);
        assert_eq!(after.roots, vec![new_root.public()]);
        let next = manifest(6);
        let refused = verify(&next, &signed(&old, &next), &after, NOW).unwrap_err();
        assert!(
            matches!(refused, ReleaseRefusal::UnknownRoot { .. }),
            "{refused}"
        );
        let under_new = keys_with_root(new_root);
        verify(&next, &signed(&under_new, &next), &after, NOW).unwrap();
        // A revocation: the revoked key is refused by name, whatever root certified it.
        let revoking = manifest_trusting(7, vec![], vec![old.release.public()]);
        let read = verify(&revoking, &signed(&under_new, &revoking), &after, NOW).unwrap();
        let revoked = after.after(&read);
        assert_eq!(revoked.roots, after.roots, "no roots named: the roots stay");
        // A release cannot revoke the key that signed it.
        let self_revoking = manifest_trusting(8, vec![], vec![under_new.release.public()]);
        let signature = signed(&under_new, &self_revoking);
        let refused = verify(&self_revoking, &signature, &after, NOW).unwrap_err();
        assert_eq!(
            refused.to_string(),
            format!(
                "the release is malformed: it revokes {}, the key that signed it",
                under_new.release.public()
            )
        );
        let stolen = Keys {
            root: under_new.root,
            release: old.release,
        };
        let refused = verify(&next, &signed(&stolen, &next), &revoked, NOW).unwrap_err();
        assert_eq!(
            refused.to_string(),
            format!(
                "the release key {} is revoked: sign the release with a key the fleet's root certified since",
                stolen.release.public()
            )
        );
    }

    fn keys_with_root(root: SigningKey) -> Keys {
        Keys {
            root,
            release: SigningKey::generate().unwrap().0,
        }
    }

    #[test]
    fn a_key_file_reads_back_as_the_same_key() {
        let (key, pem) = SigningKey::generate().unwrap();
        assert!(pem.starts_with("-----BEGIN PRIVATE KEY-----\n"));
        assert_eq!(SigningKey::from_pem(&pem).unwrap().public(), key.public());
        let refused =
            SigningKey::from_pem("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n");
        assert!(refused.is_err_and(|e| e.to_string().starts_with("not an Ed25519 PKCS#8 key")));
    }
}
