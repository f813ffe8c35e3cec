//! The node protocol, shared by the machine's agent (`fleet-agent`) and the coordinator
//! (`fleet-coordinator`): messages and framing, pinned TLS, join files, facts, runs.
//!
//! API: every module is public; `protocol` and `run` are the wire, `pin` and `joinfile` the
//! trust, `facts` what a machine reports. `binary`, `fsutil`, `duration` and `logging` are the
//! small helpers both binaries share.
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

pub mod binary;
pub mod content;
pub mod dial;
pub mod duration;
pub mod facts;
pub mod fsutil;
pub mod ids;
pub mod joinfile;
pub mod logging;
pub mod pin;
pub mod protocol;
pub mod run;

pub use ids::{NodeId, OpId, UploadId};
pub use run_store::{Bytes, Digest, RunId};
