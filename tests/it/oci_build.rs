//! Tests: oci_build.
