//! Signing and verifying: keys, cosign-compatible signatures, and checking an image's SBOM.
pub mod cosign;
pub mod keys;
pub mod sbom_check;
