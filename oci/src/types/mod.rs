//! The image format's types: digests, the OCI image spec's documents, printable text.
pub mod digest;
pub mod spec;
pub mod text;
