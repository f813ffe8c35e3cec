//! Content bytes this coordinator sent to nodes and received from them since it started.
use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Default)]
pub(crate) struct Traffic {
    sent: AtomicU64,
    received: AtomicU64,
}

impl Traffic {
    pub(crate) fn sent(&self, bytes: u64) {
        self.sent.fetch_add(bytes, Ordering::Relaxed);
    }

    pub(crate) fn received(&self, bytes: u64) {
        self.received.fetch_add(bytes, Ordering::Relaxed);
    }

    /// (sent, received) so far.
    pub(crate) fn totals(&self) -> (u64, u64) {
        (
            self.sent.load(Ordering::Relaxed),
            self.received.load(Ordering::Relaxed),
        )
    }
}
