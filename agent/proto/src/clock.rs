//! The protocol's times: milliseconds since the Unix epoch, read the same way on both sides
//! (leases, heartbeats, event stamps).

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
