//! The fuzz targets of every decoder that takes bytes from outside: one function per target,
//! each feeding its input to the real decoders and checking what they promise (round trips,
//! bounded memory, refusals that name what is wrong), not only that nothing panics.
//!
//! `fuzz/fuzz_targets/NAME.rs` hands libFuzzer's inputs to `NAME` (coverage-guided, on nightly:
//! `cargo xtask fuzz`); `tests/replay.rs` runs every seed in `fuzz/corpus/NAME` and every kept
//! crash in `fuzz/regressions/NAME` through the same function under `cargo test` on stable.
//! See docs/fuzzing.md.
mod docker_api;
mod frames;
mod joinfile;
mod node_records;
mod oci_documents;
mod oci_text;
pub mod support;
mod tar;

pub use docker_api::{SEP as DOCKER_SEP, docker_api};
pub use frames::frames;
pub use joinfile::joinfile;
pub use node_records::node_records;
pub use oci_documents::oci_documents;
pub use oci_text::oci_text;
pub use tar::tar;

/// A target: one input, checked; a broken promise panics.
pub type Target = fn(&[u8]);

/// Every target by name, for the replay test.
pub const TARGETS: &[(&str, Target)] = &[
    ("frames", frames),
    ("joinfile", joinfile),
    ("oci_text", oci_text),
    ("oci_documents", oci_documents),
    ("tar", tar),
    ("docker_api", docker_api),
    ("node_records", node_records),
];

/// Allocations are counted per thread, so a target can bound what a decoder holds.
#[global_allocator]
static ALLOCATOR: support::Counting = support::Counting;
