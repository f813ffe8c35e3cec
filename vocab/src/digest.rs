//! Content digests, `sha256:<64 lowercase hex>`: the one name content has everywhere (a staged
//! program, a blob, an image's layers and manifests).
use sha2::{Digest as _, Sha256};
use std::fmt;
use std::io::{self, Read};
use std::str::FromStr;

/// A SHA-256 content digest, written `sha256:<64 lowercase hex>`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest([u8; 32]);

/// Why a string is not a digest.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bad digest {0:?}: expected sha256:<64 lowercase hex digits>")]
pub struct DigestError(pub String);

impl Digest {
    /// The digest of some bytes.
    pub fn of(bytes: &[u8]) -> Digest {
        Digest(Sha256::digest(bytes).into())
    }

    /// The digest of a finished hash.
    pub fn from_hasher(hasher: Sha256) -> Digest {
        Digest(hasher.finalize().into())
    }

    /// Hashes everything a reader yields.
    pub fn of_reader(mut reader: impl Read) -> io::Result<Digest> {
        let mut hasher = Sha256::new();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match reader.read(&mut buf) {
                Ok(0) => return Ok(Digest::from_hasher(hasher)),
                Ok(n) => hasher.update(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Parses `sha256:<64 lowercase hex>`; anything else (other algorithms, upper case) is refused.
    pub fn parse(s: &str) -> Result<Digest, DigestError> {
        let bad = || DigestError(s.to_string());
        let hex_part = s.strip_prefix("sha256:").ok_or_else(bad)?;
        if hex_part.len() != 64
            || !hex_part
                .bytes()
                .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        {
            return Err(bad());
        }
        let mut raw = [0u8; 32];
        hex::decode_to_slice(hex_part, &mut raw).map_err(|_| bad())?;
        Ok(Digest(raw))
    }

    /// The 64 hex digits, without the `sha256:` prefix: the content's file name in every store.
    pub fn hex(&self) -> String {
        hex::encode(self.0)
    }

    /// The raw 32 bytes.
    pub fn bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", self.hex())
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl FromStr for Digest {
    type Err = DigestError;
    fn from_str(s: &str) -> Result<Digest, DigestError> {
        Digest::parse(s)
    }
}

/// On the wire and in records a digest is its `sha256:HEX` text; anything else fails to parse.
impl serde::Serialize for Digest {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Digest {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Digest, D::Error> {
        let text = <String as serde::Deserialize>::deserialize(d)?;
        Digest::parse(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::Digest;

    const EMPTY: &str = "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

    #[test]
    fn parses_only_lowercase_sha256_and_prints_it_back() {
        let d = Digest::parse(EMPTY).unwrap();
        assert_eq!(d, Digest::of(b""));
        assert_eq!(d, Digest::of_reader(&b""[..]).unwrap());
        assert_eq!(d.to_string(), EMPTY);
        assert_eq!(format!("{d:?}"), EMPTY);
        for bad in [
            "sha512:00",
            "sha256:ABC",
            &EMPTY.to_uppercase(),
            "sha256:",
            &EMPTY[..70],
            &EMPTY[7..],
        ] {
            let e = Digest::parse(bad).unwrap_err();
            assert_eq!(
                e.to_string(),
                format!("bad digest {bad:?}: expected sha256:<64 lowercase hex digits>")
            );
        }
    }
}
