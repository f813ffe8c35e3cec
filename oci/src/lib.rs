//! OCI image layouts, reproducible layers and registry transfers. Knows nothing of fleets.
pub mod build;
pub mod compress;
pub mod digest;
pub mod epoch;
pub mod image_index;
pub mod inspect;
pub mod layer;
pub mod layout;
pub mod spec;
// Registry transfers (issue 3).
pub mod auth;
pub mod copy;
pub mod progress;
pub mod push;
pub mod reference;
pub mod remote;
pub mod tar;
pub mod tls;

pub use digest::Digest;
pub use layout::{Layout, LayoutError, RefOrDigest};
pub use spec::{Descriptor, Index, Platform};
