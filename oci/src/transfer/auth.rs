//! Registry credentials: `--creds`, `$OCI_CREDS`, `REGISTRY_AUTH_FILE`/auth.json, Docker's config.json and credential helpers.
//!
//! A credential lives only in memory: it is never written anywhere and never printed.
use crate::types::text::printable;
use base64::Engine as _;
use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The environment variable that may hold `USER:PASS` when `--creds` is not given.
pub const CREDS_ENV: &str = "OCI_CREDS";

/// A user name and password (or token) for one registry.
#[derive(Clone, PartialEq, Eq)]
pub struct Credential {
    pub user: String,
    pub secret: String,
}

impl fmt::Debug for Credential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Credential({}, <redacted>)", self.user)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("{from} must be USER:PASS (the password is never printed)")]
    BadCreds { from: &'static str },
    #[error("cannot read the auth file {}: {source}; fix it or point {var} elsewhere", .path.display())]
    Read {
        path: PathBuf,
        var: &'static str,
        source: std::io::Error,
    },
    #[error("the auth file {} is not valid: {msg}; fix it or point {var} elsewhere", .path.display())]
    Corrupt {
        path: PathBuf,
        var: &'static str,
        msg: String,
    },
    #[error(
        "credential helper docker-credential-{helper} failed for {host}: {msg}; check that it is installed and logged in"
    )]
    Helper {
        helper: String,
        host: String,
        msg: String,
    },
}

impl Credential {
    /// Parses `USER:PASS`; `from` names the flag or variable for the error.
    pub fn parse(s: &str, from: &'static str) -> Result<Credential, AuthError> {
        match s.split_once(':') {
            Some((user, secret)) if !user.is_empty() => Ok(Credential {
                user: user.to_string(),
                secret: secret.to_string(),
            }),
            _ => Err(AuthError::BadCreds { from }),
        }
    }

    /// The `Authorization: Basic` value.
    pub fn basic(&self) -> String {
        let raw = format!("{}:{}", self.user, self.secret);
        format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(raw)
        )
    }
}

/// Finds the credential for `host` (`HOST[:PORT]`): `--creds`, then `$OCI_CREDS`, then
/// `REGISTRY_AUTH_FILE` (or `$XDG_RUNTIME_DIR/containers/auth.json`), then Docker's config.json.
pub fn find(host: &str, flag: Option<&str>) -> Result<Option<Credential>, AuthError> {
    if let Some(s) = flag {
        return Credential::parse(s, "--creds").map(Some);
    }
    if let Ok(s) = std::env::var(CREDS_ENV) {
        return Credential::parse(&s, "$OCI_CREDS").map(Some);
    }
    for (path, var) in auth_files() {
        if let Some(found) = from_file(&path, var, host)? {
            return Ok(Some(found));
        }
    }
    Ok(None)
}

/// The auth files to read, in order, with the variable that points at each.
fn auth_files() -> Vec<(PathBuf, &'static str)> {
    let mut files = Vec::new();
    if let Some(p) = std::env::var_os("REGISTRY_AUTH_FILE") {
        files.push((PathBuf::from(p), "REGISTRY_AUTH_FILE"));
    } else if let Some(run) = std::env::var_os("XDG_RUNTIME_DIR") {
        files.push((
            PathBuf::from(run).join("containers/auth.json"),
            "REGISTRY_AUTH_FILE",
        ));
    }
    if let Some(d) = std::env::var_os("DOCKER_CONFIG") {
        files.push((PathBuf::from(d).join("config.json"), "DOCKER_CONFIG"));
    } else if let Some(home) = std::env::var_os("HOME") {
        files.push((
            PathBuf::from(home).join(".docker/config.json"),
            "DOCKER_CONFIG",
        ));
    }
    files
}

/// Looks `host` up in one config.json/auth.json: `credHelpers`, then `auths`, then `credsStore`.
fn from_file(path: &Path, var: &'static str, host: &str) -> Result<Option<Credential>, AuthError> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        // A missing file just means no credentials there (as for podman and skopeo).
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(None);
        }
        Err(source) => {
            return Err(AuthError::Read {
                path: path.to_path_buf(),
                var,
                source,
            });
        }
    };
    let corrupt = |msg: String| AuthError::Corrupt {
        path: path.to_path_buf(),
        var,
        msg,
    };
    let config: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| corrupt(e.to_string()))?;
    if let Some(helper) = config
        .pointer("/credHelpers")
        .and_then(|h| h.get(host))
        .and_then(|h| h.as_str())
    {
        return helper_get(helper, host);
    }
    if let Some(auths) = config.get("auths").and_then(|a| a.as_object()) {
        let entry = auths
            .iter()
            .find(|(key, _)| auth_key_host(key) == host)
            .map(|(_, v)| v);
        if let Some(auth) = entry.and_then(|e| e.get("auth")).and_then(|a| a.as_str()) {
            let raw = base64::engine::general_purpose::STANDARD
                .decode(auth.trim())
                .map_err(|_| corrupt(format!("the auth entry for {host} is not base64")))?;
            let s = String::from_utf8(raw)
                .map_err(|_| corrupt(format!("the auth entry for {host} is not UTF-8")))?;
            return Credential::parse(&s, "the auth entry").map(Some);
        }
    }
    if let Some(store) = config.get("credsStore").and_then(|s| s.as_str()) {
        return helper_get(store, host);
    }
    Ok(None)
}

/// The host of an `auths` key, which may be written as a URL (`https://host/v1/`).
fn auth_key_host(key: &str) -> &str {
    let k = key
        .strip_prefix("https://")
        .or_else(|| key.strip_prefix("http://"))
        .unwrap_or(key);
    k.split('/').next().unwrap_or(k)
}

/// What a helper error says when the helper's answer is unusable (its stdout is never shown).
pub const HELPER_NO_JSON: &str = "it printed no JSON";
pub const HELPER_NO_FIELDS: &str = "its answer lacks Username or Secret";

/// Runs `docker-credential-NAME get` with the host on stdin; "not found" means no credential.
fn helper_get(helper: &str, host: &str) -> Result<Option<Credential>, AuthError> {
    // The host came from the command line or a config file, the words from the helper: one line.
    let fail = |msg: String| AuthError::Helper {
        helper: printable(helper).into_owned(),
        host: printable(host).into_owned(),
        msg: printable(&msg).into_owned(),
    };
    let mut command = Command::new(format!("docker-credential-{helper}"));
    // SAFETY: the hook only calls pthread_sigmask, which is async-signal-safe.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(
            &mut command,
            crate::local::cleanup::unblock_for_child,
        );
    }
    let mut child = command
        .arg("get")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| fail(e.to_string()))?;
    child
        .stdin
        .take()
        // Cannot fail: the helper was spawned with a piped stdin just above.
        .expect("stdin is piped")
        .write_all(host.as_bytes())
        .map_err(|e| fail(e.to_string()))?;
    let out = child.wait_with_output().map_err(|e| fail(e.to_string()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        if stdout.contains("credentials not found") {
            return Ok(None);
        }
        // The helper's stderr, not its stdout, so a secret it echoed is never shown.
        return Err(fail(
            String::from_utf8_lossy(&out.stderr).trim().to_string(),
        ));
    }
    let v: serde_json::Value =
        serde_json::from_str(&stdout).map_err(|_| fail(HELPER_NO_JSON.into()))?;
    match (
        v.get("Username").and_then(|u| u.as_str()),
        v.get("Secret").and_then(|s| s.as_str()),
    ) {
        (Some(user), Some(secret)) => Ok(Some(Credential {
            user: user.to_string(),
            secret: secret.to_string(),
        })),
        _ => Err(fail(HELPER_NO_FIELDS.into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_parse_and_never_debug_print_the_secret() {
        let c = Credential::parse("u:p:w", "--creds").unwrap();
        assert_eq!((c.user.as_str(), c.secret.as_str()), ("u", "p:w"));
        assert!(!format!("{c:?}").contains("p:w"));
        assert_eq!(c.basic(), "Basic dTpwOnc=");
        let e = Credential::parse("nopass", "--creds").unwrap_err();
        assert_eq!(
            e.to_string(),
            "--creds must be USER:PASS (the password is never printed)"
        );
    }

    #[test]
    fn auth_keys_may_be_urls() {
        assert_eq!(
            auth_key_host("https://index.docker.io/v1/"),
            "index.docker.io"
        );
        assert_eq!(auth_key_host("127.0.0.1:5000"), "127.0.0.1:5000");
    }
}
