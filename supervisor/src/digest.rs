//! Program digests, `sha256:<64 lowercase hex>`: the name a program is staged and checked under.
use crate::Error;
use sha2::{Digest as _, Sha256};
use std::fmt;
use std::io::{self, Read};

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Digest {
    hex: String,
}

impl Digest {
    pub fn parse(s: &str) -> Result<Self, Error> {
        let hex = s
            .strip_prefix("sha256:")
            .filter(|h| h.len() == 64 && h.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
            .ok_or_else(|| Error::BadDigest(s.to_string()))?;
        Ok(Self {
            hex: hex.to_string(),
        })
    }

    /// The digest of a finished hash.
    pub fn from_hasher(hasher: Sha256) -> Self {
        Self {
            hex: hex::encode(hasher.finalize()),
        }
    }

    /// Hashes everything a reader yields.
    pub fn of_reader(mut reader: impl Read) -> io::Result<Self> {
        let mut hasher = Sha256::new();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match reader.read(&mut buf) {
                Ok(0) => return Ok(Self::from_hasher(hasher)),
                Ok(n) => hasher.update(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// The 64 hex digits, which are also the staged program's file name.
    pub fn hex(&self) -> &str {
        &self.hex
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", self.hex)
    }
}

/// On the wire and in records a digest is its `sha256:HEX` text; anything else fails to parse.
impl serde::Serialize for Digest {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Digest {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        Digest::parse(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::Digest;

    #[test]
    fn parses_only_lowercase_sha256() {
        let hex = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
        let d = Digest::parse(&format!("sha256:{hex}")).unwrap();
        assert_eq!(d, Digest::of_reader(&b""[..]).unwrap());
        assert_eq!(d.to_string(), format!("sha256:{hex}"));
        for bad in [
            hex.to_string(),
            format!("sha256:{}", hex.to_uppercase()),
            "sha256:ab".into(),
        ] {
            assert!(Digest::parse(&bad).is_err(), "{bad}");
        }
    }
}
