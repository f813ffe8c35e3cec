//! [`Changes`]: runs whose state a runtime learned may have changed on its own (the engine said
//! a container ended, a timeout's timer stopped one), so the agent syncs them at
//! once instead of at its next watch. The watch stays: a change missed here (the engine's
//! event stream cut) is still seen there.
use fleet_proto::RunId;
use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

/// Shared between a runtime (which notes) and the agent's session (which takes); cloning it
/// shares it.
#[derive(Clone, Default)]
pub struct Changes(Arc<Inner>);

#[derive(Default)]
struct Inner {
    runs: Mutex<BTreeSet<RunId>>,
    noted: tokio::sync::Notify,
}

impl Changes {
    /// Notes that `run_id` may have changed; never blocks.
    pub fn note(&self, run_id: &RunId) {
        self.0
            .runs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(run_id.clone());
        self.0.noted.notify_one();
    }

    /// The runs noted since the last call, waiting for one if there is none. Cancel-safe: what
    /// it takes, it returns in the same poll.
    pub async fn next(&self) -> BTreeSet<RunId> {
        loop {
            let runs = std::mem::take(
                &mut *self
                    .0
                    .runs
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner),
            );
            if !runs.is_empty() {
                return runs;
            }
            // A note between the take and here leaves a permit, so it is not missed.
            self.0.noted.notified().await;
        }
    }
}

impl std::fmt::Debug for Changes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Changes").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_note_before_the_wait_is_not_lost_and_each_run_comes_once() {
        let id = |s: &str| RunId::parse(s).unwrap();
        let changes = Changes::default();
        changes.note(&id("a"));
        changes.note(&id("b"));
        changes.note(&id("a"));
        assert_eq!(changes.next().await, BTreeSet::from([id("a"), id("b")]));
        let waiting = tokio::spawn({
            let changes = changes.clone();
            async move { changes.next().await }
        });
        tokio::task::yield_now().await;
        changes.note(&id("c"));
        assert_eq!(waiting.await.unwrap(), BTreeSet::from([id("c")]));
    }
}
