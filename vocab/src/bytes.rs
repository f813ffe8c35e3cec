//! Bytes that may not be UTF-8 (argv, output ends): a JSON string when they are valid UTF-8,
//! otherwise `{"hex": "..."}`, so every byte round-trips.
use serde::{Deserialize, Deserializer, Serialize, Serializer};

#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Bytes(pub Vec<u8>);

#[derive(Serialize, Deserialize)]
#[serde(untagged)]
enum BytesRepr {
    Text(String),
    Hex { hex: String },
}

impl Serialize for Bytes {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match std::str::from_utf8(&self.0) {
            Ok(text) => BytesRepr::Text(text.to_string()),
            Err(_) => BytesRepr::Hex {
                hex: hex::encode(&self.0),
            },
        }
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for Bytes {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match BytesRepr::deserialize(d)? {
            BytesRepr::Text(text) => Ok(Bytes(text.into_bytes())),
            BytesRepr::Hex { hex } => hex::decode(hex)
                .map(Bytes)
                .map_err(serde::de::Error::custom),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Bytes;

    #[test]
    fn text_stays_text_and_other_bytes_round_trip_as_hex() {
        let text = serde_json::to_string(&Bytes(b"a b".to_vec())).unwrap();
        assert_eq!(text, "\"a b\"");
        let raw = Bytes(vec![0xff, 0x00]);
        let json = serde_json::to_string(&raw).unwrap();
        assert_eq!(json, r#"{"hex":"ff00"}"#);
        assert_eq!(serde_json::from_str::<Bytes>(&json).unwrap(), raw);
    }
}
