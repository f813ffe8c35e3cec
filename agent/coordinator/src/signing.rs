//! The fleet's signing policy: with keys in `DATA/signers.pem`, `run --image` is taken only for an
//! image whose digest carries a valid cosign-format signature by one of them, checked against the
//! registry (with the run's registry credential) when the run is submitted. The run's row records
//! the key; the digest pins what the node pulls.
use crate::CoordinatorError;
use fleet_proto::run::{ImageRef, RegistryAuth};
use oci::signing::keys::PublicKey;
use oci::transfer::endpoint::Endpoint;
use oci::transfer::reference::RegistryRef;
use std::path::{Path, PathBuf};

/// The policy's file in the data folder: the trusted public keys, PEM, one after another.
pub const SIGNERS_FILE: &str = "signers.pem";

/// Where Docker keeps per-registry CAs and client certificates; the coordinator reads the same.
const CERTS_DIR: &str = "/etc/docker/certs.d";

/// The keys a fleet trusts to sign the images it runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SigningPolicy {
    keys: Vec<PublicKey>,
}

pub fn signers_path(data: &Path) -> PathBuf {
    data.join(SIGNERS_FILE)
}

impl SigningPolicy {
    /// The keys, each `sha256:` of its DER.
    pub fn key_ids(&self) -> Vec<String> {
        self.keys.iter().map(PublicKey::id).collect()
    }

    /// The policy in `data`, or None when the fleet requires no signature.
    pub fn load(data: &Path) -> Result<Option<SigningPolicy>, CoordinatorError> {
        let path = signers_path(data);
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => {
                return Err(CoordinatorError::Request(format!(
                    "cannot read the signing policy {}: {e}",
                    path.display()
                )));
            }
        };
        let keys = parse_keys(&text).map_err(|e| {
            CoordinatorError::Request(format!(
                "the signing policy {} is corrupt ({e}): set it again with `fleet-coordinator policy --require-signature PUB`",
                path.display()
            ))
        })?;
        Ok(Some(SigningPolicy { keys }))
    }

    /// Reads the public key files an operator names; one line naming a file that is not one.
    pub fn from_files(files: &[PathBuf]) -> Result<SigningPolicy, CoordinatorError> {
        let keys = files
            .iter()
            .map(|f| PublicKey::read(f).map_err(|e| CoordinatorError::Request(e.to_string())))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(SigningPolicy { keys })
    }

    /// Writes the policy into `data` atomically (mode 0600, like the key beside it).
    pub fn save(&self, data: &Path) -> Result<(), CoordinatorError> {
        let text: String = self.keys.iter().map(PublicKey::to_pem).collect();
        let path = signers_path(data);
        fleet_content::files::write_private(&path, text.as_bytes())
            .map_err(|e| CoordinatorError::Request(format!("cannot write {}: {e}", path.display())))
    }

    /// Removes the policy: the fleet runs any image again.
    pub fn clear(data: &Path) -> Result<(), CoordinatorError> {
        let path = signers_path(data);
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(CoordinatorError::Request(format!(
                "cannot remove {}: {e}",
                path.display()
            ))),
        }
    }

    /// The key that signed `image`, or the line that refuses the run.
    pub async fn check(
        &self,
        image: &ImageRef,
        auth: Option<&RegistryAuth>,
    ) -> Result<String, CoordinatorError> {
        let refused = |why: String| {
            CoordinatorError::Request(format!(
                "the fleet runs only images signed by {} and refuses {image}: {why}",
                self.key_ids().join(", ")
            ))
        };
        let reference = RegistryRef {
            host: image.host.clone(),
            repo: image.repository.clone(),
            tag: None,
            digest: Some(image.digest),
        };
        let tls = oci::transfer::tls::TlsOptions {
            cert: None,
            key: None,
            ca: None,
            certs_dir: Some(PathBuf::from(CERTS_DIR)),
            // As the Docker engine does, a registry on loopback is spoken to in plain HTTP.
            plain_http: is_loopback(&image.host),
        };
        let credential = auth.map(|a| oci::transfer::auth::Credential {
            user: a.username.clone(),
            secret: a.password.clone(),
        });
        let client = oci::transfer::remote::Client::new(&image.host, &tls, credential)
            .map_err(|e| refused(e.to_string()))?;
        let ep = Endpoint::Registry { client, reference };
        let verified = oci::signing::cosign::verify(&ep, &self.keys)
            .await
            .map_err(|e| refused(e.to_string()))?;
        Ok(verified.key)
    }
}

/// Every `PUBLIC KEY` block of a PEM text (at least one).
fn parse_keys(text: &str) -> Result<Vec<PublicKey>, String> {
    const BEGIN: &str = "-----BEGIN PUBLIC KEY-----";
    let keys = text
        .match_indices(BEGIN)
        .map(|(at, _)| PublicKey::from_pem(&text[at..]))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    if keys.is_empty() {
        return Err("it holds no public key".into());
    }
    Ok(keys)
}

/// `127.0.0.0/8`, `::1` or `localhost`, with or without a port.
fn is_loopback(host: &str) -> bool {
    let name = match host.rsplit_once(':') {
        Some((n, p)) if p.chars().all(|c| c.is_ascii_digit()) => n,
        _ => host,
    };
    let name = name.trim_start_matches('[').trim_end_matches(']');
    name == "localhost"
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_hosts_are_told_apart() {
        for host in [
            "127.0.0.1:5000",
            "localhost",
            "localhost:80",
            "[::1]:5000",
            "127.3.2.1",
        ] {
            assert!(is_loopback(host), "{host}");
        }
        for host in [
            "registry.example:5000",
            "10.0.0.1:5000",
            "[2001:db8::1]:443",
        ] {
            assert!(!is_loopback(host), "{host}");
        }
    }
}
