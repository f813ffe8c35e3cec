//! Images on this machine: the OCI layout folder, reproducible layers and builds, indexes, inspection and the SBOM.
pub mod build;
pub mod cleanup;
pub mod compress;
pub mod epoch;
pub mod image_index;
pub mod inspect;
pub mod layer;
pub mod layout;
pub mod sbom;
pub mod tar;
