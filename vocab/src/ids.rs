//! The protocol's ids, one type each, so one is never passed where another belongs: a node, a
//! command's operation, a set of runs, an upload.
use serde::{Deserialize, Serialize};
use std::fmt;

macro_rules! text_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(String);

        impl $name {
            pub fn new(id: impl Into<String>) -> $name {
                $name(id.into())
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl From<&str> for $name {
            fn from(id: &str) -> $name {
                $name::new(id)
            }
        }

        impl PartialEq<&str> for $name {
            fn eq(&self, other: &&str) -> bool {
                self.0 == *other
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    };
}

text_id!(
    /// A node of the fleet, named by the coordinator when it joined.
    NodeId
);
text_id!(
    /// One command sent to a node: the node records its answer under it, so a redelivery is
    /// answered from the record and never done twice.
    OpId
);
text_id!(
    /// A set of runs asked for together (`run --count`, `--all`), named by the coordinator.
    SetId
);
text_id!(
    /// One collect's upload, named by the coordinator: what a resumed try continues.
    UploadId
);
