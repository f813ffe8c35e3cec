//! The connections `serve` holds: at most a cap of them at once (a semaphore; the rest wait in
//! the listen backlog, with one line in the log each time the cap is reached), each a task in
//! one set, so a shutdown can wait for them for a grace and then cut what is left.
use crate::recorder::Recorder;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;

pub(super) struct Connections {
    cap: Arc<Semaphore>,
    max: usize,
    tasks: JoinSet<()>,
    /// Whether the cap was reached and not left since: its line is logged once per time.
    full: bool,
    recorder: Recorder,
}

/// How a drain went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Drained {
    /// Connections open when the drain began.
    pub open: usize,
    /// Of those, how many ended by themselves within the grace.
    pub ended: usize,
    /// Of those, how many were cut when the grace ran out.
    pub cut: usize,
}

impl Connections {
    pub(super) fn new(max: usize, recorder: Recorder) -> Connections {
        let max = max.max(1);
        Connections {
            cap: Arc::new(Semaphore::new(max)),
            max,
            tasks: JoinSet::new(),
            full: false,
            recorder,
        }
    }

    /// A place for the next connection, waiting while the cap is reached.
    pub(super) async fn permit(&mut self) -> OwnedSemaphorePermit {
        self.reap();
        if let Ok(permit) = self.cap.clone().try_acquire_owned() {
            self.full = false;
            return permit;
        }
        if !self.full {
            self.full = true;
            self.recorder.cap_reached();
            tracing::warn!(
                max_connections = self.max,
                "the connection cap of {} is reached: new connections wait in the listen backlog until one closes; raise --max-connections (and the open-file limit) for more",
                self.max
            );
        }
        // Cannot fail: this owner never calls `close` on its semaphore.
        (self.cap.clone().acquire_owned().await).expect("the cap's semaphore is never closed")
    }

    /// Serves one connection in its place; the place is free again when what `serve` makes
    /// ends. A maker, not a future: an async block that captured a whole session's future and
    /// awaited it would hold it twice over (upvars are not overlapped), doubling every
    /// connection's memory.
    pub(super) fn spawn<F, Fut>(&mut self, permit: OwnedSemaphorePermit, serve: F)
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let open = self.recorder.connection_open();
        self.tasks.spawn(async move {
            let (_place, _open) = (permit, open);
            serve().await;
        });
    }

    /// Connections open now.
    #[cfg(test)]
    fn open(&mut self) -> usize {
        self.reap();
        self.tasks.len()
    }

    /// Waits up to `grace` for every connection to end, then cuts the rest; none is left.
    pub(super) async fn drain(mut self, grace: Duration) -> Drained {
        self.reap();
        let open = self.tasks.len();
        let deadline = tokio::time::Instant::now() + grace;
        let mut ended = 0;
        while !self.tasks.is_empty() {
            tokio::select! {
                _ = tokio::time::sleep_until(deadline) => break,
                Some(task) = self.tasks.join_next() => {
                    note_panic(task);
                    ended += 1;
                }
            }
        }
        let cut = self.tasks.len();
        self.tasks.shutdown().await;
        Drained { open, ended, cut }
    }

    /// Waits for a connection to end, logging it if it panicked; pending while none is open.
    pub(super) async fn ended(&mut self) {
        match self.tasks.join_next().await {
            Some(task) => note_panic(task),
            None => std::future::pending().await,
        }
    }

    /// Forgets the connections that ended, logging one that panicked.
    fn reap(&mut self) {
        while let Some(task) = self.tasks.try_join_next() {
            note_panic(task);
        }
    }
}

/// A connection's task that panicked took only its own connection down: say so, with the panic.
fn note_panic(ended: Result<(), tokio::task::JoinError>) {
    let Err(e) = ended else { return };
    if !e.is_panic() {
        return;
    }
    let payload = e.into_panic();
    let what = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "no message".into());
    tracing::error!(
        "a connection's task panicked ({what}): that connection is closed, every other one is served on; report this as a bug"
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::watch;

    #[tokio::test(start_paused = true)]
    async fn past_the_cap_the_next_connection_waits_until_one_ends() {
        let mut connections = Connections::new(2, Recorder::default());
        let (end_first, first_ends) = tokio::sync::oneshot::channel::<()>();
        let p1 = connections.permit().await;
        connections.spawn(p1, move || async move {
            let _ = first_ends.await;
        });
        let p2 = connections.permit().await;
        connections.spawn(p2, std::future::pending);
        assert_eq!(connections.open(), 2);
        let waited = tokio::time::timeout(Duration::from_secs(3600), connections.permit()).await;
        assert!(
            waited.is_err(),
            "a third connection waits while two are open"
        );
        assert!(connections.full, "the cap's line was logged");
        end_first.send(()).unwrap();
        let third = tokio::time::timeout(Duration::from_secs(1), connections.permit()).await;
        let third = third.expect("once one ended, the next is served");
        assert!(
            connections.full,
            "still at the cap: its line is not logged again"
        );
        drop(third);
        let _fourth = connections.permit().await;
        assert!(
            !connections.full,
            "below the cap again: a later reach is logged"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_drain_waits_for_what_ends_and_cuts_the_rest_at_the_grace() {
        let mut connections = Connections::new(1000, Recorder::default());
        let (stop, stopping) = watch::channel(false);
        // Each task holds a clone: once every task is gone, only this one is left.
        let held = Arc::new(());
        for _ in 0..100 {
            let (mut stopping, held) = (stopping.clone(), held.clone());
            let permit = connections.permit().await;
            connections.spawn(permit, move || async move {
                let _held = held;
                let _ = stopping.wait_for(|s| *s).await;
                // A session writes its last frames after the signal.
                tokio::time::sleep(Duration::from_millis(100)).await;
            });
        }
        let (permit, stuck) = (connections.permit().await, held.clone());
        connections.spawn(permit, move || async move {
            let _held = stuck;
            std::future::pending::<()>().await
        });
        stop.send(true).unwrap();
        let began = tokio::time::Instant::now();
        let drained = connections.drain(Duration::from_secs(10)).await;
        assert_eq!(
            drained,
            Drained {
                open: 101,
                ended: 100,
                cut: 1
            }
        );
        assert_eq!(began.elapsed(), Duration::from_secs(10), "cut at the grace");
        assert_eq!(Arc::strong_count(&held), 1, "no task is left");
    }

    #[tokio::test(start_paused = true)]
    async fn a_drain_of_connections_that_all_end_takes_no_longer_than_they_do() {
        let mut connections = Connections::new(10, Recorder::default());
        let permit = connections.permit().await;
        connections.spawn(permit, || tokio::time::sleep(Duration::from_millis(300)));
        let began = tokio::time::Instant::now();
        let drained = connections.drain(Duration::from_secs(10)).await;
        assert_eq!((drained.open, drained.ended, drained.cut), (1, 1, 0));
        assert_eq!(began.elapsed(), Duration::from_millis(300));
    }
}
