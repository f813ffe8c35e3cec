//! The node protocol, shared by the machine's agent (`fleet-agent`) and the coordinator
//! (`fleet-coordinator`): messages and framing, pinned TLS, join files, facts, runs.
//!
//! API: every module is public; `protocol`, `run` and `clock` are the wire, `pin`, `dial` and
//! `joinfile` the trust, `facts` what a machine reports. The words it speaks in (digests, run,
//! node, operation and upload ids) are `fleet-vocab`'s, re-exported here.
/// Serde for a type that travels as its text: written by `Display`, read back by `$parse`
/// (`fn(&str) -> Result<Self, String>`), whose refusal is the decoder's error.
macro_rules! serde_as_text {
    ($type:ty, $parse:path) => {
        impl serde::Serialize for $type {
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.collect_str(self)
            }
        }

        impl<'de> serde::Deserialize<'de> for $type {
            fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                let text = <String as serde::Deserialize>::deserialize(deserializer)?;
                $parse(&text).map_err(serde::de::Error::custom)
            }
        }
    };
}

pub mod check;
pub mod clock;
pub mod dial;
pub mod facts;
pub mod joinfile;
pub mod pin;
pub mod protocol;
pub mod release;
pub mod run;
pub mod unit;
pub mod version;

pub use fleet_vocab::{Bytes, Digest, NodeId, OpId, RunId, SetId, UploadId};
