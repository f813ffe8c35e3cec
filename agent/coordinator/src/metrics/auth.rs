//! Who may read the metrics and the status endpoints off loopback: a bearer token kept in a file
//! only its owner reads, compared in constant time.
use sha2::{Digest as _, Sha256};
use std::path::{Path, PathBuf};

/// The token a request must carry as `Authorization: Bearer TOKEN`. Only its hash is held.
#[derive(Clone)]
pub struct BearerToken([u8; 32]);

impl std::fmt::Debug for BearerToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BearerToken(redacted)")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error(
        "cannot read the metrics token file {path}: {cause}; write the token into it (chmod 600)"
    )]
    Unreadable {
        path: PathBuf,
        cause: std::io::Error,
    },
    #[error("the metrics token file {path} is empty: write a long random token into it")]
    Empty { path: PathBuf },
    #[error("the metrics token file {path} can be read by others (mode {mode:o}): chmod 600 it")]
    Exposed { path: PathBuf, mode: u32 },
}

impl BearerToken {
    /// Reads the token from `path`: the whole file, surrounding whitespace trimmed. Refused when
    /// missing, empty, or readable by the group or others.
    pub fn from_file(path: &Path) -> Result<BearerToken, AuthError> {
        use std::os::unix::fs::PermissionsExt;
        let unreadable = |cause| AuthError::Unreadable {
            path: path.to_path_buf(),
            cause,
        };
        let mode = std::fs::metadata(path)
            .map_err(unreadable)?
            .permissions()
            .mode();
        if mode & 0o077 != 0 {
            return Err(AuthError::Exposed {
                path: path.to_path_buf(),
                mode: mode & 0o777,
            });
        }
        let text = std::fs::read_to_string(path).map_err(unreadable)?;
        let token = text.trim();
        if token.is_empty() {
            return Err(AuthError::Empty {
                path: path.to_path_buf(),
            });
        }
        Ok(BearerToken(Sha256::digest(token.as_bytes()).into()))
    }

    /// Whether an `Authorization` header's value carries this token. The hashes are compared
    /// whole, so the time taken says nothing about how much of a guess was right.
    pub(crate) fn admits(&self, authorization: Option<&str>) -> bool {
        let Some(offered) = authorization.and_then(|v| v.trim().strip_prefix("Bearer ")) else {
            return false;
        };
        let offered: [u8; 32] = Sha256::digest(offered.trim().as_bytes()).into();
        let differ = (offered.iter().zip(&self.0)).fold(0u8, |acc, (a, b)| acc | (a ^ b));
        std::hint::black_box(differ) == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn token_file(dir: &Path, text: &str, mode: u32) -> PathBuf {
        let path = dir.join("token");
        std::fs::write(&path, text).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        path
    }

    #[test]
    fn only_the_exact_token_is_admitted() {
        let dir = tempfile::tempdir().unwrap();
        let token = BearerToken::from_file(&token_file(dir.path(), "s3cret\n", 0o600)).unwrap();
        assert!(token.admits(Some("Bearer s3cret")));
        assert!(!token.admits(Some("Bearer s3cre")));
        assert!(!token.admits(Some("Bearer s3cret2")));
        assert!(!token.admits(Some("Basic s3cret")));
        assert!(!token.admits(None));
        assert_eq!(format!("{token:?}"), "BearerToken(redacted)");
    }

    #[test]
    fn a_bad_token_file_is_refused_with_its_line() {
        let dir = tempfile::tempdir().unwrap();
        let exposed = BearerToken::from_file(&token_file(dir.path(), "t", 0o644)).unwrap_err();
        assert!(
            exposed
                .to_string()
                .ends_with("can be read by others (mode 644): chmod 600 it"),
            "{exposed}"
        );
        let empty = BearerToken::from_file(&token_file(dir.path(), " \n", 0o600)).unwrap_err();
        assert!(empty.to_string().contains("is empty"), "{empty}");
        let missing = BearerToken::from_file(&dir.path().join("nope")).unwrap_err();
        assert!(
            missing
                .to_string()
                .starts_with("cannot read the metrics token file"),
            "{missing}"
        );
    }
}
