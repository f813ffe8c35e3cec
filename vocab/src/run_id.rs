//! Run ids: 1 to 64 characters of `[A-Za-z0-9._-]`, never `.` or `..`, so an id is always one
//! safe path component.
use std::fmt;

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RunId(String);

/// Why a string is not a run id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bad run id {0:?}: use 1 to 64 characters of A-Z a-z 0-9 . _ - (not . or ..)")]
pub struct RunIdError(pub String);

impl RunId {
    pub fn parse(s: &str) -> Result<Self, RunIdError> {
        let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
        if s.is_empty() || s.len() > 64 || s == "." || s == ".." || !s.chars().all(allowed) {
            return Err(RunIdError(s.to_string()));
        }
        Ok(Self(s.to_string()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl PartialEq<&str> for RunId {
    fn eq(&self, other: &&str) -> bool {
        self.0 == *other
    }
}

impl fmt::Display for RunId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// On the wire and in records a run id is its text; one that is not a safe component fails to parse.
impl serde::Serialize for RunId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> serde::Deserialize<'de> for RunId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = <String as serde::Deserialize>::deserialize(d)?;
        RunId::parse(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::RunId;

    #[test]
    fn accepts_safe_components_only() {
        for good in ["a", "build-1.2_x", ".hidden", "..x", &"z".repeat(64)] {
            assert!(RunId::parse(good).is_ok(), "{good}");
        }
        for bad in ["", ".", "..", "a/b", "a b", "ü", &"z".repeat(65), "a\0b"] {
            assert!(RunId::parse(bad).is_err(), "{bad:?}");
        }
    }
}
