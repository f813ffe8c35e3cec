//! Tests: oci_remote.
