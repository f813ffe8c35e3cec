//! OCI image layouts, reproducible layers and registry transfers. Knows nothing of fleets.
pub mod build;
pub mod cleanup;
pub mod compress;
pub mod digest;
pub mod epoch;
pub mod image_index;
pub mod inspect;
pub mod layer;
pub mod layout;
pub mod sbom;
pub mod spec;
// Registry transfers (issue 3).
pub mod attach;
pub mod auth;
pub mod carry;
pub mod copy;
pub mod cosign;
pub mod keys;
pub mod progress;
pub mod push;
pub mod reference;
pub mod referrers;
pub mod remote;
pub mod sbom_check;
pub mod tar;
pub mod text;
pub mod tls;

pub use digest::Digest;
pub use layout::{Layout, LayoutError, RefOrDigest};
pub use spec::{Descriptor, Index, Platform};

/// An I/O error as a message ends with it: one the user can fix by permissions says so.
pub fn io_detail(e: &std::io::Error) -> String {
    if e.kind() == std::io::ErrorKind::PermissionDenied {
        format!("{e}: give the user running oci access to it, or run oci as a user that has it")
    } else {
        e.to_string()
    }
}
