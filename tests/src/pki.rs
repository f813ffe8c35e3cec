//! A throwaway PKI for the registry tests: a CA, a server certificate for loopback and a client certificate.
use std::path::{Path, PathBuf};
use std::process::Command;

/// PEM files of a fresh CA and the certificates it signed, all in one temporary folder.
pub struct Pki {
    _dir: tempfile::TempDir,
    pub ca_cert: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
    /// A client certificate as a bare `openssl x509 -req` makes it: no extensions, so X.509 version 1.
    pub client_v1_cert: PathBuf,
    pub client_v1_key: PathBuf,
    /// A second, unrelated CA: a client trusting only it finds the server untrusted.
    pub other_ca_cert: PathBuf,
    /// A client certificate signed by the unrelated CA, which the registry refuses.
    pub stranger_cert: PathBuf,
    pub stranger_key: PathBuf,
}

impl Pki {
    /// Generates the CA and certificates with openssl (an independent tool, not our TLS code).
    pub fn new() -> Pki {
        let dir = crate::tempdir();
        let d = dir.path();
        ca(d, "ca", "fleet test ca");
        ca(d, "other-ca", "unrelated test ca");
        leaf(
            d,
            "server",
            "ca",
            "subjectAltName=IP:127.0.0.1,IP:::1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
        );
        leaf(d, "client", "ca", "extendedKeyUsage=clientAuth\n");
        leaf(d, "client-v1", "ca", "");
        leaf(d, "stranger", "other-ca", "extendedKeyUsage=clientAuth\n");
        Pki {
            ca_cert: d.join("ca.crt"),
            server_cert: d.join("server.crt"),
            server_key: d.join("server.key"),
            client_cert: d.join("client.crt"),
            client_key: d.join("client.key"),
            client_v1_cert: d.join("client-v1.crt"),
            client_v1_key: d.join("client-v1.key"),
            other_ca_cert: d.join("other-ca.crt"),
            stranger_cert: d.join("stranger.crt"),
            stranger_key: d.join("stranger.key"),
            _dir: dir,
        }
    }
}

impl Default for Pki {
    fn default() -> Self {
        Pki::new()
    }
}

fn openssl(dir: &Path, args: &[&str]) {
    crate::ok(Command::new("openssl").current_dir(dir).args(args));
}

/// `openssl req` with a fresh P-256 key `NAME.key`: a signing request in `out`, or with
/// `-x509` among `extra` a self-signed certificate.
fn req_with_new_key(dir: &Path, name: &str, cn: &str, out: &str, extra: &[&str]) {
    let (key, subj) = (format!("{name}.key"), format!("/CN={cn}"));
    let mut args = vec![
        "req",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
        "-keyout",
        &key,
        "-out",
        out,
        "-subj",
        &subj,
    ];
    args.extend_from_slice(extra);
    openssl(dir, &args);
}

fn ca(dir: &Path, name: &str, cn: &str) {
    let crt = format!("{name}.crt");
    req_with_new_key(
        dir,
        name,
        cn,
        &crt,
        &[
            "-x509",
            "-days",
            "2",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ],
    );
}

/// A certificate signed by `ca`; with no `extensions`, a bare `openssl x509 -req` (version 1).
fn leaf(dir: &Path, name: &str, ca: &str, extensions: &str) {
    let (csr, crt) = (format!("{name}.csr"), format!("{name}.crt"));
    let ext = format!("{name}.ext");
    req_with_new_key(dir, name, name, &csr, &[]);
    let (ca_crt, ca_key) = (format!("{ca}.crt"), format!("{ca}.key"));
    let mut args = vec![
        "x509",
        "-req",
        "-in",
        &csr,
        "-CA",
        &ca_crt,
        "-CAkey",
        &ca_key,
        "-CAcreateserial",
        "-out",
        &crt,
        "-days",
        "2",
    ];
    if !extensions.is_empty() {
        std::fs::write(dir.join(&ext), extensions).expect("can write the extensions file");
        args.extend(["-extfile", &ext]);
    }
    openssl(dir, &args);
}
