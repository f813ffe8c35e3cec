//! ECDSA P-256 keys as PEM files: a private key in PKCS#8 (`openssl genpkey`) or SEC1
//! (`openssl ecparam -genkey`), a public key as SubjectPublicKeyInfo (`openssl pkey -pubout`,
//! `cosign.pub`). Signatures are ASN.1 DER over SHA-256, as cosign and `openssl dgst` make them.
use base64::Engine as _;
use ring::rand::SystemRandom;
use ring::signature::{
    ECDSA_P256_SHA256_ASN1, ECDSA_P256_SHA256_ASN1_SIGNING, EcdsaKeyPair, KeyPair,
    UnparsedPublicKey,
};
use std::fmt;
use std::path::{Path, PathBuf};

/// The DER prefix of a P-256 SubjectPublicKeyInfo (id-ecPublicKey, prime256v1, a 66-byte BIT
/// STRING); the uncompressed point (0x04, X, Y) follows.
const P256_SPKI_PREFIX: [u8; 26] = [
    0x30, 0x59, 0x30, 0x13, 0x06, 0x07, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01, 0x06, 0x08, 0x2a,
    0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07, 0x03, 0x42, 0x00,
];
/// The AlgorithmIdentifier of a P-256 key, inside PKCS#8.
const P256_ALGORITHM: [u8; 21] = [
    0x30, 0x13, 0x06, 0x07, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01, 0x06, 0x08, 0x2a, 0x86, 0x48,
    0xce, 0x3d, 0x03, 0x01, 0x07,
];

#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("cannot read key {}: {detail}", .path.display())]
    Read { path: PathBuf, detail: String },
    #[error(
        "{} is cosign's encrypted key, which oci does not read: give an unencrypted ECDSA P-256 key in PEM (openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out KEY)",
        .path.display()
    )]
    CosignEncrypted { path: PathBuf },
    #[error("{} is {what}", .path.display())]
    WrongHalf { path: PathBuf, what: &'static str },
    #[error(
        "{} is not {want}: {detail}; make one with {how}",
        .path.display()
    )]
    Format {
        path: PathBuf,
        want: &'static str,
        detail: String,
        how: &'static str,
    },
}

const PRIVATE_HOW: &str = "openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out KEY";
const PUBLIC_HOW: &str = "openssl pkey -in KEY -pubout -out KEY.pub";

/// Why a PEM public key cannot be read, in one line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct PemError(String);

/// A public key that checks signatures.
#[derive(Clone, PartialEq, Eq)]
pub struct PublicKey {
    /// The SubjectPublicKeyInfo DER, which also names the key (its SHA-256).
    spki: Vec<u8>,
}

impl fmt::Debug for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PublicKey({})", self.id())
    }
}

impl PublicKey {
    /// Reads a PEM `PUBLIC KEY` file.
    pub fn read(path: &Path) -> Result<PublicKey, KeyError> {
        let text = read(path)?;
        if text.contains("PRIVATE KEY-----") {
            return Err(KeyError::WrongHalf {
                path: path.to_path_buf(),
                what: "a private key: give the public key made from it (openssl pkey -in KEY -pubout -out KEY.pub)",
            });
        }
        let bad = |detail: String| KeyError::Format {
            path: path.to_path_buf(),
            want: "an ECDSA P-256 public key in PEM (BEGIN PUBLIC KEY)",
            detail,
            how: PUBLIC_HOW,
        };
        Self::from_pem(&text).map_err(|e| bad(e.to_string()))
    }

    /// A PEM `PUBLIC KEY` block; the error says what is wrong with it.
    pub fn from_pem(text: &str) -> Result<PublicKey, PemError> {
        Self::from_pem_line(text).map_err(PemError)
    }

    fn from_pem_line(text: &str) -> Result<PublicKey, String> {
        let der = pem_block(text, "PUBLIC KEY")?;
        Self::from_spki(&der)
    }

    fn from_spki(der: &[u8]) -> Result<PublicKey, String> {
        if der.len() != P256_SPKI_PREFIX.len() + 65
            || der[..P256_SPKI_PREFIX.len()] != P256_SPKI_PREFIX
        {
            return Err("it is not a P-256 (prime256v1) key with an uncompressed point".into());
        }
        if der[P256_SPKI_PREFIX.len()] != 0x04 {
            return Err("its point is not uncompressed".into());
        }
        Ok(PublicKey { spki: der.to_vec() })
    }

    /// `sha256:` and the hex SHA-256 of the key's DER: how the key is named in answers and rows.
    pub fn id(&self) -> String {
        crate::types::digest::Digest::of(&self.spki).to_string()
    }

    /// The PEM text of the key.
    pub fn to_pem(&self) -> String {
        pem_encode("PUBLIC KEY", &self.spki)
    }

    /// Whether `signature` (ASN.1 DER) is this key's over `message`.
    pub fn verifies(&self, message: &[u8], signature: &[u8]) -> bool {
        UnparsedPublicKey::new(
            &ECDSA_P256_SHA256_ASN1,
            &self.spki[P256_SPKI_PREFIX.len()..],
        )
        .verify(message, signature)
        .is_ok()
    }
}

/// A private key that signs.
pub struct SigningKey {
    pair: EcdsaKeyPair,
    rng: SystemRandom,
}

impl SigningKey {
    /// Reads a PEM `PRIVATE KEY` (PKCS#8) or `EC PRIVATE KEY` (SEC1) file.
    pub fn read(path: &Path) -> Result<SigningKey, KeyError> {
        let text = read(path)?;
        if text.contains("ENCRYPTED SIGSTORE PRIVATE KEY") || text.contains("ENCRYPTED COSIGN") {
            return Err(KeyError::CosignEncrypted {
                path: path.to_path_buf(),
            });
        }
        if text.contains("-----BEGIN PUBLIC KEY-----") {
            return Err(KeyError::WrongHalf {
                path: path.to_path_buf(),
                what: "a public key, which only verifies: sign with the private key it was made from",
            });
        }
        let bad = |detail: String| KeyError::Format {
            path: path.to_path_buf(),
            want: "an unencrypted ECDSA P-256 private key in PEM (BEGIN PRIVATE KEY or BEGIN EC PRIVATE KEY)",
            detail,
            how: PRIVATE_HOW,
        };
        let pkcs8 = match pem_block(&text, "PRIVATE KEY") {
            Ok(der) => der,
            Err(_) => pkcs8_of_sec1(&pem_block(&text, "EC PRIVATE KEY").map_err(bad)?),
        };
        let rng = SystemRandom::new();
        let pair = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, &pkcs8, &rng)
            .map_err(|e| bad(format!("it is not a P-256 key ({e})")))?;
        Ok(SigningKey { pair, rng })
    }

    /// The ASN.1 DER signature of `message` (SHA-256, a fresh random nonce each time).
    pub fn sign(&self, message: &[u8]) -> Vec<u8> {
        self.pair
            .sign(&self.rng, message)
            .map(|s| s.as_ref().to_vec())
            // ring fails only when the system's random source does, which no caller can repair.
            .expect("the system random source works")
    }

    /// Its public key.
    pub fn public(&self) -> PublicKey {
        let mut spki = P256_SPKI_PREFIX.to_vec();
        spki.extend_from_slice(self.pair.public_key().as_ref());
        PublicKey { spki }
    }
}

fn read(path: &Path) -> Result<String, KeyError> {
    std::fs::read_to_string(path).map_err(|e| KeyError::Read {
        path: path.to_path_buf(),
        detail: crate::io_detail(&e),
    })
}

/// The DER inside the first `-----BEGIN LABEL-----` block.
fn pem_block(text: &str, label: &str) -> Result<Vec<u8>, String> {
    let begin = format!("-----BEGIN {label}-----");
    let end = format!("-----END {label}-----");
    let start = text
        .find(&begin)
        .ok_or_else(|| format!("it has no {begin} line"))?
        + begin.len();
    let stop = text[start..]
        .find(&end)
        .ok_or_else(|| format!("it has no {end} line"))?;
    let body: String = text[start..start + stop]
        .chars()
        .filter(|c| !c.is_whitespace())
        .collect();
    base64::engine::general_purpose::STANDARD
        .decode(body)
        .map_err(|e| format!("its base64 is broken ({e})"))
}

fn pem_encode(label: &str, der: &[u8]) -> String {
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let mut out = format!("-----BEGIN {label}-----\n");
    for line in b64.as_bytes().chunks(64) {
        out.push_str(&String::from_utf8_lossy(line));
        out.push('\n');
    }
    out + &format!("-----END {label}-----\n")
}

/// A SEC1 `ECPrivateKey` wrapped as PKCS#8 v1 (ring reads only PKCS#8).
fn pkcs8_of_sec1(sec1: &[u8]) -> Vec<u8> {
    let mut body = vec![0x02, 0x01, 0x00];
    body.extend_from_slice(&P256_ALGORITHM);
    body.extend(der_tlv(0x04, sec1));
    der_tlv(0x30, &body)
}

fn der_tlv(tag: u8, content: &[u8]) -> Vec<u8> {
    let mut out = vec![tag];
    let len = content.len();
    if len < 0x80 {
        out.push(len as u8);
    } else if len < 0x100 {
        out.extend([0x81, len as u8]);
    } else {
        out.extend([0x82, (len >> 8) as u8, len as u8]);
    }
    out.extend_from_slice(content);
    out
}
