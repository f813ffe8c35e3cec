//! The TLS client configuration for one registry: trusted roots, an optional client identity, Docker's certs.d.
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Docker's per-host certificate folder, read by default (`--certs-dir` changes it).
pub const DEFAULT_CERTS_DIR: &str = "/etc/docker/certs.d";

/// What the command line says about TLS for one side of a transfer.
#[derive(Debug, Clone, Default)]
pub struct TlsOptions {
    /// PEM client certificate chain (`--tls-cert`).
    pub cert: Option<PathBuf>,
    /// PEM private key of the client certificate (`--tls-key`).
    pub key: Option<PathBuf>,
    /// PEM CA certificates to trust besides the system's (`--tls-ca`).
    pub ca: Option<PathBuf>,
    /// The certs.d root: `DIR/HOST:PORT/` holds `*.crt` CAs and `*.cert`/`*.key` client pairs.
    pub certs_dir: Option<PathBuf>,
    /// Talk plain HTTP (`--plain-http`): nothing is insecure unless asked for.
    pub plain_http: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {what} {}: {source}; check {flag}", .path.display())]
    Read {
        what: &'static str,
        path: PathBuf,
        flag: &'static str,
        source: std::io::Error,
    },
    #[error("{} holds no PEM {what}; pass a PEM file to {flag}", .path.display())]
    NoPem {
        what: &'static str,
        path: PathBuf,
        flag: &'static str,
    },
    #[error("--tls-cert and --tls-key go together: pass both or neither")]
    HalfIdentity,
    #[error("the client certificate {} does not go with its key {} (their public keys differ): pass the matching --tls-key", .cert.display(), .key.display())]
    KeyMismatch { cert: PathBuf, key: PathBuf },
    #[error("the private key {} is not usable: {source}; pass an RSA, ECDSA or Ed25519 key in PEM to --tls-key", .path.display())]
    BadKey {
        path: PathBuf,
        source: rustls::Error,
    },
    #[error("the client certificate {} is not an X.509 certificate: pass a PEM certificate to --tls-cert", .path.display())]
    BadCert { path: PathBuf },
    #[error("the CA certificate in {} is not usable: {source}; pass a PEM CA certificate to --tls-ca", .path.display())]
    BadCa {
        path: PathBuf,
        source: rustls::Error,
    },
}

/// A ready rustls configuration and what went into it (error messages depend on it).
#[derive(Debug, Clone)]
pub struct TlsSetup {
    pub config: Arc<rustls::ClientConfig>,
    /// Where the client certificate came from, if one is presented.
    pub client_cert: Option<PathBuf>,
    /// The certs.d folder for this host, for messages.
    pub host_dir: PathBuf,
}

impl TlsOptions {
    /// The rustls configuration for `host` (`HOST[:PORT]`): system roots plus `--tls-ca` plus
    /// certs.d CAs; the client identity from `--tls-cert/--tls-key`, else from certs.d.
    pub fn setup(&self, host: &str) -> Result<TlsSetup, TlsError> {
        let root = self
            .certs_dir
            .clone()
            .unwrap_or_else(|| PathBuf::from(DEFAULT_CERTS_DIR));
        let host_dir = root.join(host);
        let mut roots = rustls::RootCertStore::empty();
        // Unreadable system certificates only narrow what is trusted, so they are skipped.
        for cert in rustls_native_certs::load_native_certs().certs {
            let _ = roots.add(cert);
        }
        let mut ca_files: Vec<PathBuf> = self.ca.iter().cloned().collect();
        ca_files.extend(certs_d_files(&host_dir, "crt"));
        for path in &ca_files {
            for cert in read_certs(path, "CA certificate", "--tls-ca")? {
                roots.add(cert).map_err(|source| TlsError::BadCa {
                    path: path.clone(),
                    source,
                })?;
            }
        }
        let identity = match (&self.cert, &self.key) {
            (Some(c), Some(k)) => Some((c.clone(), k.clone())),
            (None, None) => certs_d_files(&host_dir, "cert")
                .into_iter()
                .find_map(|cert| {
                    let key = cert.with_extension("key");
                    key.is_file().then_some((cert, key))
                }),
            _ => return Err(TlsError::HalfIdentity),
        };
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            // Cannot fail: the ring provider supports rustls' default protocol versions.
            .expect("ring supports the default protocol versions")
            .with_root_certificates(roots);
        let config = match &identity {
            Some((cert, key)) => {
                let identity = client_identity(&provider, cert, key)?;
                builder.with_client_cert_resolver(Arc::new(rustls::sign::SingleCertAndKey::from(
                    identity,
                )))
            }
            None => builder.with_no_client_auth(),
        };
        Ok(TlsSetup {
            config: Arc::new(config),
            client_cert: identity.map(|(c, _)| c),
            host_dir,
        })
    }
}

/// The client certificate chain and its key. The registry decides whether it accepts the
/// certificate (of X.509 version 1 or 3); here only the key is checked to go with it, by comparing
/// the certificate's SubjectPublicKeyInfo with the key's. (rustls' own check parses the certificate
/// with webpki, which refuses version 1.)
fn client_identity(
    provider: &rustls::crypto::CryptoProvider,
    cert: &Path,
    key: &Path,
) -> Result<rustls::sign::CertifiedKey, TlsError> {
    let chain = read_certs(cert, "client certificate", "--tls-cert")?;
    let private = provider
        .key_provider
        .load_private_key(read_key(key)?)
        .map_err(|source| TlsError::BadKey {
            path: key.to_path_buf(),
            source,
        })?;
    let cert_spki = certificate_spki(&chain[0]).ok_or_else(|| TlsError::BadCert {
        path: cert.to_path_buf(),
    })?;
    if let Some(key_spki) = private.public_key()
        && key_spki.as_ref() != cert_spki
    {
        return Err(TlsError::KeyMismatch {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
        });
    }
    Ok(rustls::sign::CertifiedKey::new(chain, private))
}

/// One DER element: its tag, all its bytes, its contents, and what follows it.
struct Der<'a> {
    tag: u8,
    whole: &'a [u8],
    contents: &'a [u8],
    rest: &'a [u8],
}

fn der(input: &[u8]) -> Option<Der<'_>> {
    let tag = *input.first()?;
    let first = *input.get(1)? as usize;
    let (len, header) = if first < 0x80 {
        (first, 2)
    } else {
        let n = first & 0x7f;
        if n == 0 || n > 4 {
            return None;
        }
        let mut len = 0usize;
        for i in 0..n {
            len = (len << 8) | *input.get(2 + i)? as usize;
        }
        (len, 2 + n)
    };
    let end = header.checked_add(len).filter(|&e| e <= input.len())?;
    Some(Der {
        tag,
        whole: &input[..end],
        contents: &input[header..end],
        rest: &input[end..],
    })
}

/// The DER SubjectPublicKeyInfo of a certificate: the seventh field of its TBSCertificate, or the
/// sixth in version 1, which has no `[0] version`.
fn certificate_spki(cert: &[u8]) -> Option<&[u8]> {
    const SEQUENCE: u8 = 0x30;
    let certificate = der(cert).filter(|e| e.tag == SEQUENCE)?;
    let tbs = der(certificate.contents).filter(|e| e.tag == SEQUENCE)?;
    let mut rest = tbs.contents;
    if rest.first() == Some(&0xa0) {
        rest = der(rest)?.rest;
    }
    // serialNumber, signature, issuer, validity, subject
    for _ in 0..5 {
        rest = der(rest)?.rest;
    }
    der(rest)
        .filter(|e| e.tag == SEQUENCE)
        .map(|spki| spki.whole)
}

/// The files of one extension in a host's certs.d folder, sorted (a missing folder has none).
fn certs_d_files(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == ext))
        .collect();
    files.sort();
    files
}

fn read_file(path: &Path, what: &'static str, flag: &'static str) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.to_path_buf(),
        flag,
        source,
    })
}

fn read_certs(
    path: &Path,
    what: &'static str,
    flag: &'static str,
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read_file(path, what, flag)?;
    let certs: Vec<_> = rustls_pemfile::certs(&mut pem.as_slice())
        .filter_map(Result::ok)
        .collect();
    if certs.is_empty() {
        return Err(TlsError::NoPem {
            what,
            path: path.to_path_buf(),
            flag,
        });
    }
    Ok(certs)
}

fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let (what, flag) = ("private key", "--tls-key");
    let pem = read_file(path, what, flag)?;
    match rustls_pemfile::private_key(&mut pem.as_slice()) {
        Ok(Some(key)) => Ok(key),
        _ => Err(TlsError::NoPem {
            what,
            path: path.to_path_buf(),
            flag,
        }),
    }
}
