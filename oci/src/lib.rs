//! OCI image layouts, reproducible layers and registry transfers. Knows nothing of fleets.
//! Four parts, each using only those before it: `types` (digests and the spec's documents),
//! `local` (the layout folder, builds, the SBOM), `transfer` (registries, push, copy,
//! referrers) and `signing` (keys, signatures, SBOM checks).
pub mod local;
pub mod signing;
pub mod transfer;
pub mod types;

pub use local::layout::{Layout, LayoutError, RefOrDigest};
pub use types::digest::Digest;
pub use types::spec::{Descriptor, Index, Platform};

/// An I/O error as a message ends with it: one the user can fix by permissions says so.
pub fn io_detail(e: &std::io::Error) -> String {
    if e.kind() == std::io::ErrorKind::PermissionDenied {
        format!("{e}: give the user running oci access to it, or run oci as a user that has it")
    } else {
        e.to_string()
    }
}
