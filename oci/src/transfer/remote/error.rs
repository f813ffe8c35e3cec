//! What can go wrong talking to a registry, each as one line that says what to do.
use crate::transfer::tls::TlsSetup;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    #[error("cannot resolve registry host {host}: check the host name in the reference")]
    Resolve { host: String },
    #[error(
        "cannot connect to registry {host}: connection refused; check the host and port and that the registry is running"
    )]
    Refused { host: String },
    #[error("registry {host} presented a certificate that is not trusted ({detail}): pass its CA with --tls-ca FILE or put it in {}/ca.crt", .dir.display())]
    Untrusted {
        host: String,
        detail: String,
        dir: PathBuf,
    },
    #[error("registry {host} requires a client certificate: pass --tls-cert FILE and --tls-key FILE or put client.cert and client.key in {}", .dir.display())]
    NeedClientCert { host: String, dir: PathBuf },
    #[error("registry {host} rejected the client certificate {}: pass --tls-cert with one signed by a CA the registry trusts", .cert.display())]
    ClientCertRejected { host: String, cert: PathBuf },
    #[error("registry {host} does not answer TLS: pass --plain-http if it serves plain HTTP")]
    NotTls { host: String },
    #[error(
        "registry {host} answered plain HTTP with something else: drop --plain-http if it serves TLS"
    )]
    NotPlain { host: String },
    #[error("TLS with registry {host} failed: {detail}; check --tls-cert, --tls-key and --tls-ca")]
    Tls { host: String, detail: String },
    #[error("cannot talk to registry {host}: {detail}; check the network and try again")]
    Network { host: String, detail: String },
    #[error(
        "registry {host} needs credentials for {repo} (401 unauthorized): pass --creds USER:PASS, set $OCI_CREDS or log in with docker login"
    )]
    NeedCreds { host: String, repo: String },
    #[error(
        "registry {host} refused the credentials for {repo} (401 unauthorized): check the user and password given by --creds or the auth file"
    )]
    BadCreds { host: String, repo: String },
    #[error(
        "registry {host} denied {action} access to {repo} (403 forbidden): use credentials allowed to {action} there"
    )]
    Forbidden {
        host: String,
        repo: String,
        action: &'static str,
    },
    #[error("{what} not found (404): check the repository, tag and digest")]
    NotFound { what: String },
    #[error(
        "registry {host} does not accept media type {media_type} ({status}): push to a registry that supports it"
    )]
    MediaTypeRefused {
        host: String,
        media_type: String,
        status: u16,
    },
    #[error(
        "{what} has media type {media_type}, which oci does not handle: only OCI and Docker schema 2 manifests and indexes can be copied"
    )]
    MediaTypeUnknown { what: String, media_type: String },
    #[error("{0}; the source is corrupt: rebuild or re-pull it")]
    Mismatch(String),
    #[error(
        "registry {host} kept answering {status} to {method} {path} after {tries} tries: try again later"
    )]
    Exhausted {
        host: String,
        status: u16,
        method: String,
        path: String,
        tries: u32,
    },
    #[error("registry {host} answered {status} for {path}{detail}")]
    Unexpected {
        host: String,
        status: u16,
        path: String,
        detail: String,
    },
    #[error("registry {host} sent a bad answer to {method} {path}: {detail}")]
    BadAnswer {
        host: String,
        method: String,
        path: String,
        detail: String,
    },
    #[error(transparent)]
    Layout(#[from] crate::local::layout::LayoutError),
    #[error(transparent)]
    TlsConfig(#[from] crate::transfer::tls::TlsError),
    #[error(transparent)]
    Auth(#[from] crate::transfer::auth::AuthError),
}

/// Turns a transport failure into the message an operator can act on.
pub fn classify(err: &reqwest::Error, host: &str, tls: Option<&TlsSetup>) -> RemoteError {
    let host = host.to_string();
    let mut detail = err.to_string();
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = cause {
        if let Some(r) = rustls_error(e) {
            return classify_rustls(r, host, tls);
        }
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            if io.kind() == std::io::ErrorKind::ConnectionRefused {
                return RemoteError::Refused { host };
            }
            let text = io.to_string();
            // rustls reports a non-TLS peer as a corrupt or oversized record.
            if tls.is_some()
                && (text.contains("InvalidContentType") || text.contains("corrupt message"))
            {
                return RemoteError::NotTls { host };
            }
        }
        let text = e.to_string();
        if text.contains("invalid HTTP version") || text.contains("invalid HTTP") {
            return RemoteError::NotPlain { host };
        }
        if tls.is_some_and(|t| t.client_cert.is_none())
            && (text.contains("connection reset")
                || text.contains("connection closed before message completed"))
        {
            // A server that requires a client certificate may just hang up on one without.
            return need_client_cert(host, tls);
        }
        detail = text;
        cause = e.source();
    }
    RemoteError::Network { host, detail }
}

fn rustls_error<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a rustls::Error> {
    if let Some(r) = e.downcast_ref::<rustls::Error>() {
        return Some(r);
    }
    // io::Error::source skips the error it wraps, so wrapped io errors are unwrapped by hand.
    let mut io = e.downcast_ref::<std::io::Error>()?;
    loop {
        let inner = io.get_ref()?;
        if let Some(r) = inner.downcast_ref::<rustls::Error>() {
            return Some(r);
        }
        io = inner.downcast_ref::<std::io::Error>()?;
    }
}

fn need_client_cert(host: String, tls: Option<&TlsSetup>) -> RemoteError {
    let dir = tls.map(|t| t.host_dir.clone()).unwrap_or_default();
    RemoteError::NeedClientCert { host, dir }
}

fn classify_rustls(e: &rustls::Error, host: String, tls: Option<&TlsSetup>) -> RemoteError {
    use rustls::AlertDescription as A;
    let client_cert = tls.and_then(|t| t.client_cert.clone());
    match e {
        rustls::Error::InvalidCertificate(why) => RemoteError::Untrusted {
            host,
            detail: format!("{why:?}").to_lowercase(),
            dir: tls.map(|t| t.host_dir.clone()).unwrap_or_default(),
        },
        rustls::Error::AlertReceived(
            A::CertificateRequired | A::BadCertificate | A::HandshakeFailure | A::UnknownCA,
        ) if client_cert.is_none() => need_client_cert(host, tls),
        rustls::Error::AlertReceived(
            A::BadCertificate | A::UnknownCA | A::CertificateUnknown | A::DecryptError,
        ) => RemoteError::ClientCertRejected {
            host,
            cert: client_cert.unwrap_or_default(),
        },
        rustls::Error::InvalidMessage(_) => RemoteError::NotTls { host },
        other => RemoteError::Tls {
            host,
            detail: other.to_string(),
        },
    }
}
