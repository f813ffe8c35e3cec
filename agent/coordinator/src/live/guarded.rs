//! The one lock each owner keeps its state behind. A panic while it was held cannot leave the
//! state half-changed (every owner changes it in one step), so a poisoned lock is taken as is.
use std::sync::{Mutex, MutexGuard, PoisonError};

#[derive(Default)]
pub(super) struct Guarded<T>(Mutex<T>);

impl<T> Guarded<T> {
    pub(super) fn lock(&self) -> MutexGuard<'_, T> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
