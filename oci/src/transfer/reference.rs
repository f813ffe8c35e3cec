//! Image references with their transport: `oci:DIR:REF`, `oci:DIR@sha256:HEX`, `docker://HOST[:PORT]/REPO[:TAG|@sha256:HEX]`.
use crate::local::layout::RefOrDigest;
use crate::types::digest::Digest;
use std::fmt;
use std::path::PathBuf;

/// What every bad reference message ends with: the forms that are accepted.
const FORMS: &str =
    "use oci:DIR:REF, oci:DIR@sha256:HEX or docker://HOST[:PORT]/REPO[:TAG|@sha256:HEX]";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("bad reference {input:?}: {why}; {FORMS}")]
pub struct ReferenceError {
    input: String,
    why: &'static str,
}

/// An image named by transport and location.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageRef {
    Layout(LayoutRef),
    Registry(RegistryRef),
}

/// An image in an OCI layout folder, by ref name (index.json annotation) or by manifest digest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayoutRef {
    pub dir: PathBuf,
    pub image: RefOrDigest,
}

/// An image in a registry repository, by tag and/or digest (the digest wins when both are given).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegistryRef {
    /// `HOST` or `HOST:PORT`, as the registry is addressed and as certs.d and auth files key it.
    pub host: String,
    pub repo: String,
    pub tag: Option<String>,
    pub digest: Option<Digest>,
}

impl RegistryRef {
    /// What to ask the registry for: the digest if pinned, else the tag.
    pub fn reference(&self) -> String {
        match (&self.digest, &self.tag) {
            (Some(d), _) => d.to_string(),
            (None, Some(t)) => t.clone(),
            (None, None) => "latest".to_string(),
        }
    }

    /// The same repository with another reference (a child manifest of an index, say).
    pub fn with_digest(&self, digest: &Digest) -> RegistryRef {
        RegistryRef {
            digest: Some(*digest),
            tag: None,
            ..self.clone()
        }
    }
}

impl fmt::Display for ImageRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ImageRef::Layout(l) => write!(f, "{l}"),
            ImageRef::Registry(r) => write!(f, "{r}"),
        }
    }
}

impl fmt::Display for LayoutRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.image {
            RefOrDigest::Name(n) => write!(f, "oci:{}:{n}", self.dir.display()),
            RefOrDigest::Digest(d) => write!(f, "oci:{}@{d}", self.dir.display()),
        }
    }
}

impl fmt::Display for RegistryRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "docker://{}/{}", self.host, self.repo)?;
        if let Some(t) = &self.tag {
            write!(f, ":{t}")?;
        }
        if let Some(d) = &self.digest {
            write!(f, "@{d}")?;
        }
        Ok(())
    }
}

impl std::str::FromStr for ImageRef {
    type Err = ReferenceError;

    fn from_str(input: &str) -> Result<ImageRef, ReferenceError> {
        let bad = |why| ReferenceError {
            input: input.to_string(),
            why,
        };
        if let Some(rest) = input.strip_prefix("oci:") {
            parse_layout(rest).map(ImageRef::Layout).map_err(bad)
        } else if let Some(rest) = input.strip_prefix("docker://") {
            parse_registry(rest).map(ImageRef::Registry).map_err(bad)
        } else {
            Err(bad("unknown transport"))
        }
    }
}

fn parse_digest(s: &str) -> Result<Digest, &'static str> {
    s.parse::<Digest>()
        .map_err(|_| "the digest is not sha256: followed by 64 lowercase hex digits")
}

fn parse_layout(rest: &str) -> Result<LayoutRef, &'static str> {
    // Like skopeo, the folder ends at the first ':', so a ref name may itself hold ':'.
    let (dir, image) = if let Some((dir, d)) = rest
        .rsplit_once('@')
        .filter(|(_, d)| d.starts_with("sha256:"))
    {
        (dir, RefOrDigest::Digest(parse_digest(d)?))
    } else if let Some((dir, name)) = rest.split_once(':') {
        let image = RefOrDigest::parse(name)
            .map_err(|_| "the ref name must be letters and digits separated by . _ - : @ + or /")?;
        (dir, image)
    } else {
        return Err("the layout needs :REF or @sha256:HEX after its folder");
    };
    if dir.is_empty() {
        return Err("the layout folder is empty");
    }
    Ok(LayoutRef {
        dir: PathBuf::from(dir),
        image,
    })
}

fn parse_registry(rest: &str) -> Result<RegistryRef, &'static str> {
    let (host, path) = rest
        .split_once('/')
        .ok_or("the registry host must be followed by /REPO")?;
    if !valid_host(host) {
        return Err("the registry host is not HOST or HOST:PORT");
    }
    let (path, digest) = match path.split_once('@') {
        Some((p, d)) => (p, Some(parse_digest(d)?)),
        None => (path, None),
    };
    // The first ':' after the last '/' starts the tag (a tag holding ':' is a bad tag, not a bad repository).
    let last = path.rfind('/').map_or(0, |i| i + 1);
    let (repo, tag) = match path[last..].find(':') {
        Some(i) => (&path[..last + i], Some(&path[last + i + 1..])),
        None => (path, None),
    };
    if !valid_repo(repo) {
        return Err("the repository must be lowercase letters, digits and . _ - separated by /");
    }
    if tag.is_some_and(|t| !valid_tag(t)) {
        return Err("the tag must be 1 to 128 letters, digits, _ . or -, not starting with . or -");
    }
    Ok(RegistryRef {
        host: host.to_string(),
        repo: repo.to_string(),
        tag: tag.map(str::to_string),
        digest,
    })
}

fn valid_host(host: &str) -> bool {
    let (name, port) = match host.rsplit_once(':') {
        Some((n, p)) if !n.ends_with(']') || n.starts_with('[') => (n, Some(p)),
        _ => (host, None),
    };
    let name_ok = if let Some(inner) = name.strip_prefix('[').and_then(|n| n.strip_suffix(']')) {
        inner.parse::<std::net::Ipv6Addr>().is_ok()
    } else {
        !name.is_empty()
            && name.split('.').all(|label| {
                !label.is_empty()
                    && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
                    && !label.starts_with('-')
                    && !label.ends_with('-')
            })
    };
    name_ok && port.is_none_or(|p| p.parse::<u16>().is_ok_and(|p| p > 0))
}

fn valid_repo(repo: &str) -> bool {
    !repo.is_empty()
        && repo.len() <= 255
        && repo.split('/').all(|component| {
            let alnum = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
            component.starts_with(alnum)
                && component.ends_with(alnum)
                && component
                    .chars()
                    .all(|c| alnum(c) || matches!(c, '.' | '_' | '-'))
                && !component.contains("..")
                && !component.contains("___")
        })
}

fn valid_tag(tag: &str) -> bool {
    (1..=128).contains(&tag.len())
        && tag
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
        && !tag.starts_with(['.', '-'])
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEX: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

    #[test]
    fn parses_every_form() {
        let r: ImageRef = format!("docker://127.0.0.1:5000/a/b:v1@sha256:{HEX}")
            .parse()
            .unwrap();
        let ImageRef::Registry(r) = r else {
            panic!("registry")
        };
        assert_eq!(
            (r.host.as_str(), r.repo.as_str(), r.tag.as_deref()),
            ("127.0.0.1:5000", "a/b", Some("v1"))
        );
        assert_eq!(r.reference(), format!("sha256:{HEX}"));
        let r: ImageRef = "docker://[::1]:5000/app".parse().unwrap();
        let ImageRef::Registry(r) = r else {
            panic!("registry")
        };
        assert_eq!(
            (r.host.as_str(), r.reference().as_str()),
            ("[::1]:5000", "latest")
        );
        let l: ImageRef = "oci:out/x:app".parse().unwrap();
        assert_eq!(l.to_string(), "oci:out/x:app");
        let l: ImageRef = format!("oci:out@sha256:{HEX}").parse().unwrap();
        assert_eq!(l.to_string(), format!("oci:out@sha256:{HEX}"));
    }

    #[test]
    fn refuses_bad_references() {
        for bad in [
            "docker://host",
            "docker://ho st/app",
            "docker://host:99999/app",
            "docker://host/App",
            "docker://host/app:",
            "docker://host/app@sha256:abc",
            "oci:dir",
            "http://host/app",
            "docker://host/team/app:bad:tag",
        ] {
            let err = bad.parse::<ImageRef>().unwrap_err().to_string();
            assert!(
                err.starts_with(&format!("bad reference {bad:?}: ")),
                "{err}"
            );
            assert!(err.ends_with(FORMS), "{err}");
        }
        // A second ':' is in the tag, so the tag is what is reported.
        let err = "docker://host/team/app:bad:tag"
            .parse::<ImageRef>()
            .unwrap_err();
        assert_eq!(
            err.why,
            "the tag must be 1 to 128 letters, digits, _ . or -, not starting with . or -"
        );
    }
}
