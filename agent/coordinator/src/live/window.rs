//! The fetch window: how many nodes may be fetching a program from this coordinator at once
//! because it sent them a stage. A dispatch to every node then becomes a steady stream of
//! fetches instead of one connection per node at the same moment, which would cost an open
//! file and a TLS state each (past the process's open-file limit at 10 000 nodes).
use std::sync::{Arc, OnceLock};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Stages in flight at once when `serve` does not say.
pub const DEFAULT_FETCH_WINDOW: u32 = 256;

#[derive(Default)]
pub(crate) struct FetchWindow {
    slots: OnceLock<Arc<Semaphore>>,
}

/// A stage's place in the window, given back when dropped (its answer came, or its session
/// ended).
pub(crate) type FetchSlot = OwnedSemaphorePermit;

impl FetchWindow {
    /// Sets the window's size; only the first call counts (at `serve`).
    pub(crate) fn open(&self, size: usize) {
        let _ = self.slots.set(Arc::new(Semaphore::new(size.max(1))));
    }

    fn slots(&self) -> Arc<Semaphore> {
        let default = || Arc::new(Semaphore::new(DEFAULT_FETCH_WINDOW as usize));
        self.slots.get_or_init(default).clone()
    }

    /// A slot now, or None when the window is full.
    pub(crate) fn try_take(&self) -> Option<FetchSlot> {
        self.slots().try_acquire_owned().ok()
    }

    /// The next slot that frees, in the order sessions asked.
    pub(crate) async fn take(&self) -> FetchSlot {
        // Cannot fail: the semaphore is never closed.
        (self.slots().acquire_owned().await).expect("the fetch window is never closed")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_full_window_gives_a_slot_once_one_is_given_back() {
        let window = FetchWindow::default();
        window.open(2);
        let (a, _b) = (window.try_take().unwrap(), window.try_take().unwrap());
        assert!(window.try_take().is_none(), "the window holds two");
        let waiting = window.take();
        drop(a);
        let _c = tokio::time::timeout(std::time::Duration::from_secs(5), waiting)
            .await
            .expect("a freed slot is taken");
        assert!(window.try_take().is_none());
    }
}
