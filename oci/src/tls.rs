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
    #[error("the client certificate {} does not go with its key {}: {source}; pass the matching --tls-key", .cert.display(), .key.display())]
    BadIdentity {
        cert: PathBuf,
        key: PathBuf,
        source: rustls::Error,
    },
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
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("ring supports the default protocol versions")
            .with_root_certificates(roots);
        let config = match &identity {
            Some((cert, key)) => {
                let chain = read_certs(cert, "client certificate", "--tls-cert")?;
                let private = read_key(key)?;
                builder
                    .with_client_auth_cert(chain, private)
                    .map_err(|source| TlsError::BadIdentity {
                        cert: cert.clone(),
                        key: key.clone(),
                        source,
                    })?
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
