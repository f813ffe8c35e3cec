//! Peers pinned by public key: Ed25519 key text, short-lived self-signed certificates, and the
//! rustls verifiers that compare a certificate's key with the pinned one (no CA, no TOFU).
use base64::Engine;
use rcgen::{CertificateParams, KeyPair};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How a public key is written in join files, logs and `nodes`.
pub const KEY_PREFIX: &str = "ed25519:";
/// The Ed25519 algorithm identifier (RFC 8410).
const ED25519_OID: &str = "1.3.101.112";
/// Certificates are back-dated this much so a peer whose clock is a little behind accepts them.
pub const CLOCK_SKEW: Duration = Duration::from_secs(60);

/// `ed25519:<base64 of the 32 raw key bytes>`.
pub fn key_text(raw: &[u8]) -> String {
    format!(
        "{KEY_PREFIX}{}",
        base64::engine::general_purpose::STANDARD.encode(raw)
    )
}

/// The raw key bytes of `ed25519:<base64>`, or None when the text is not such a key.
pub fn parse_key_text(text: &str) -> Option<Vec<u8>> {
    let b64 = text.strip_prefix(KEY_PREFIX)?;
    let raw = base64::engine::general_purpose::STANDARD.decode(b64).ok()?;
    (raw.len() == 32).then_some(raw)
}

/// A pinned Ed25519 public key: read from `ed25519:<base64 of 32 bytes>` or refused, so a
/// corrupt key can never quietly become an empty pin.
#[derive(Clone, PartialEq, Eq)]
pub struct PinnedKey([u8; 32]);

/// Why a pinned key's text (`ed25519:<base64>`) cannot be read, in one line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct KeyTextError(String);

impl PinnedKey {
    pub fn parse(text: &str) -> Result<PinnedKey, KeyTextError> {
        Self::parse_line(text).map_err(KeyTextError)
    }

    fn parse_line(text: &str) -> Result<PinnedKey, String> {
        let raw = parse_key_text(text)
            .ok_or_else(|| format!("`{text}` is not ed25519:<base64 of 32 bytes>"))?;
        Ok(PinnedKey(
            // Cannot fail: `parse_key_text` returns only 32-byte keys.
            raw.try_into().expect("parse_key_text returns 32 bytes"),
        ))
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Display for PinnedKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&key_text(&self.0))
    }
}

impl std::fmt::Debug for PinnedKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PinnedKey({self})")
    }
}

serde_as_text!(PinnedKey, PinnedKey::parse);

/// What a peer's certificate says: its key and its validity window (Unix seconds).
#[derive(Debug, Clone)]
pub struct CertInfo {
    pub key: Vec<u8>,
    pub not_before: i64,
    pub not_after: i64,
}

/// Reads the Ed25519 key and validity of a certificate; anything else is refused.
pub fn cert_info(der: &[u8]) -> Result<CertInfo, rustls::Error> {
    let bad = || rustls::Error::InvalidCertificate(rustls::CertificateError::BadEncoding);
    let (_, cert) = x509_parser::parse_x509_certificate(der).map_err(|_| bad())?;
    let spki = cert.public_key();
    if spki.algorithm.algorithm.to_id_string() != ED25519_OID {
        return Err(bad());
    }
    Ok(CertInfo {
        key: spki.subject_public_key.data.to_vec(),
        not_before: cert.validity().not_before.timestamp(),
        not_after: cert.validity().not_after.timestamp(),
    })
}

/// A fresh self-signed certificate for `key`, valid from a little before now for `validity`.
pub fn mint_cert(
    key: &KeyPair,
    validity: Duration,
) -> Result<CertificateDer<'static>, rcgen::Error> {
    let mut params = CertificateParams::new(vec!["fleet".to_string()])?;
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - CLOCK_SKEW;
    params.not_after = now + validity;
    Ok(params.self_signed(key)?.der().clone())
}

fn private_key(key: &KeyPair) -> PrivateKeyDer<'static> {
    PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()))
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The server name the agent asks for; the verifier ignores it because the key is what is pinned.
pub fn server_name() -> ServerName<'static> {
    // Cannot fail: a constant that is a valid DNS name.
    ServerName::try_from("fleet-coordinator").expect("a valid DNS name")
}

/// A TLS 1.3 client that presents `cert` and talks only to a server holding the `pinned` key.
/// When the server shows another key, it is written to `seen` so the caller can say which.
pub fn client_config(
    key: &KeyPair,
    cert: CertificateDer<'static>,
    pinned: Vec<u8>,
    seen: Arc<Mutex<Option<Vec<u8>>>>,
) -> Result<Arc<rustls::ClientConfig>, rustls::Error> {
    let provider = provider();
    let verifier = PinnedServer {
        pinned,
        seen,
        provider: provider.clone(),
    };
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_client_auth_cert(vec![cert], private_key(key))?;
    config.resumption = rustls::client::Resumption::disabled();
    Ok(Arc::new(config))
}

/// A TLS 1.3 server that requires a client certificate and proves its holder has the key;
/// which keys are welcome is decided after the handshake, from the store.
pub fn server_config(
    key: &KeyPair,
    cert: CertificateDer<'static>,
) -> Result<Arc<rustls::ServerConfig>, rustls::Error> {
    let provider = provider();
    let verifier = AnyEd25519Client {
        provider: provider.clone(),
    };
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(Arc::new(verifier))
        .with_single_cert(vec![cert], private_key(key))?;
    // No tickets: nothing to resume, and the next server bytes after the handshake are the answer.
    config.send_tls13_tickets = 0;
    config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    Ok(Arc::new(config))
}

/// The handshake-signature methods both verifiers share (the two rustls traits declare the same
/// three): TLS 1.3 only, Ed25519 only, checked with the verifier's `provider`.
macro_rules! ed25519_tls13_signatures {
    () => {
        fn verify_tls12_signature(
            &self,
            _message: &[u8],
            _cert: &CertificateDer<'_>,
            _dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            Err(rustls::Error::PeerIncompatible(
                rustls::PeerIncompatible::Tls12NotOffered,
            ))
        }

        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls13_signature(
                message,
                cert,
                dss,
                &self.provider.signature_verification_algorithms,
            )
        }

        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            vec![SignatureScheme::ED25519]
        }
    };
}

#[derive(Debug)]
struct PinnedServer {
    pinned: Vec<u8>,
    seen: Arc<Mutex<Option<Vec<u8>>>>,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for PinnedServer {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let info = cert_info(end_entity)?;
        if info.key != self.pinned {
            *self
                .seen
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(info.key);
            return Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::ApplicationVerificationFailure,
            ));
        }
        Ok(ServerCertVerified::assertion())
    }

    ed25519_tls13_signatures!();
}

#[derive(Debug)]
struct AnyEd25519Client {
    provider: Arc<CryptoProvider>,
}

impl ClientCertVerifier for AnyEd25519Client {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        cert_info(end_entity)?;
        Ok(ClientCertVerified::assertion())
    }

    ed25519_tls13_signatures!();
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_pinned_key_reads_back_as_written_and_a_corrupt_one_is_refused() {
        let raw = [7u8; 32];
        let key = PinnedKey::parse(&key_text(&raw)).unwrap();
        assert_eq!(key.as_bytes(), raw);
        let json = serde_json::to_string(&key).unwrap();
        assert_eq!(json, format!("\"{}\"", key_text(&raw)));
        assert_eq!(serde_json::from_str::<PinnedKey>(&json).unwrap(), key);
        let err = serde_json::from_str::<PinnedKey>("\"ed25519:AAAA\"").unwrap_err();
        assert!(
            err.to_string()
                .starts_with("`ed25519:AAAA` is not ed25519:<base64 of 32 bytes>"),
            "{err}"
        );
    }

    use super::*;

    #[test]
    fn key_text_round_trips() {
        let key = KeyPair::generate_for(&rcgen::PKCS_ED25519).unwrap();
        let text = key_text(key.public_key_raw());
        assert_eq!(parse_key_text(&text).unwrap(), key.public_key_raw());
        assert!(parse_key_text("ed25519:AAAA").is_none());
        assert!(parse_key_text("rsa:xyz").is_none());
    }

    #[test]
    fn minted_cert_carries_the_key_and_window() {
        let key = KeyPair::generate_for(&rcgen::PKCS_ED25519).unwrap();
        let cert = mint_cert(&key, Duration::from_secs(600)).unwrap();
        let info = cert_info(&cert).unwrap();
        assert_eq!(info.key, key.public_key_raw());
        assert_eq!(info.not_after - info.not_before, 660);
    }
}
