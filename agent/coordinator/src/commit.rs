//! Group commit: every session's store changes go through one writer thread, which applies all
//! the changes waiting at that moment in one transaction ([`Store::apply`]) and answers each. A
//! fleet of sessions then costs one commit per batch, not one per message: the disk sync (redb)
//! or the round trip and WAL flush (PostgreSQL) is shared by everything that arrived meanwhile.
//! One writer on PostgreSQL too: with three or four, their batches failed each other's
//! serializable snapshots (684 retries in `bench fleet --queue`) and the queue took longer.
use crate::recorder::Recorder;
use crate::store::{Applied, Change, Store, StoreError, StoreResult};
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// At most this many changes go into one transaction: enough to share a commit among a whole
/// round of sessions, few enough that a serializable retry redoes little (on PostgreSQL a larger
/// transaction meets more false conflicts on shared index pages).
const MAX_BATCH: usize = 512;
/// While the database cannot be reached, a batch is tried again for this long (a restart, a
/// failover) before its changes are answered with the outage.
const OUTAGE_PATIENCE: Duration = Duration::from_secs(120);

type Request = (Change, oneshot::Sender<StoreResult<Applied>>);

/// The handle sessions submit changes through; dropping it ends the writer thread once the
/// changes already submitted are applied.
pub struct Committer {
    requests: Option<mpsc::Sender<Request>>,
    writer: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Committer {
    fn drop(&mut self) {
        // The writer holds the store: it must have let go when the coordinator is gone.
        drop(self.requests.take());
        if let Some(writer) = self.writer.take() {
            let _ = writer.join();
        }
    }
}

impl Committer {
    /// Starts the writer thread over `store`.
    pub fn start(store: Arc<Store>, recorder: Recorder) -> Committer {
        let (requests, inbox) = mpsc::channel::<Request>();
        let writer = std::thread::Builder::new()
            .name("store-commit".into())
            .spawn(move || write_batches(&store, &inbox, &recorder))
            // Cannot fail: at start-up only: a coordinator that cannot start a thread cannot serve at all.
            .expect("a thread for the store's commits");
        Committer {
            requests: Some(requests),
            writer: Some(writer),
        }
    }

    /// Applies `change` in the next batch and answers when that batch committed.
    pub async fn submit(&self, change: Change) -> StoreResult<Applied> {
        let gone = || StoreError::Db("the store's writer stopped".into());
        let (answer, answered) = oneshot::channel();
        let requests = self.requests.as_ref().ok_or_else(gone)?;
        requests.send((change, answer)).map_err(|_| gone())?;
        answered.await.map_err(|_| gone())?
    }
}

/// Applies the batch; while the database cannot be reached, waits and tries the same batch
/// again (each change is safe to apply twice: events are deduped by id, the rest set values),
/// so the sessions waiting on it ride out a restart.
fn apply_through_outages(store: &Store, changes: &[Change]) -> Vec<StoreResult<Applied>> {
    let since = Instant::now();
    let mut pause = Duration::from_millis(100);
    loop {
        let applied = store.apply(changes);
        let outage = applied
            .iter()
            .all(|a| a.as_ref().is_err_and(|e| e.is_outage()));
        if !outage || since.elapsed() > OUTAGE_PATIENCE {
            return applied;
        }
        if pause == Duration::from_millis(100) {
            tracing::warn!(
                "the store cannot be reached; holding {} changes until it is back",
                changes.len()
            );
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_secs(1));
    }
}

/// The changes taken from the inbox and not applied yet: session opens first, as a node waits
/// for its welcome on one while its runs' events can wait (in a 30 000-node rolling restart,
/// opens queued behind thousands of run events took over 30 s, and nodes going home gave up on
/// them, BENCHMARKS.md, run 32).
#[derive(Default)]
struct Queued {
    opens: VecDeque<Request>,
    rest: VecDeque<Request>,
}

impl Queued {
    fn push(&mut self, request: Request) {
        match request.0 {
            Change::OpenSession { .. } => self.opens.push_back(request),
            _ => self.rest.push_back(request),
        }
    }

    fn is_empty(&self) -> bool {
        self.opens.is_empty() && self.rest.is_empty()
    }

    /// The next batch: up to `limit` changes, opens first, each kind in the order it came.
    fn next_batch(&mut self, limit: usize) -> Vec<Request> {
        let opens = self.opens.len().min(limit);
        let rest = self.rest.len().min(limit - opens);
        let mut batch: Vec<Request> = self.opens.drain(..opens).collect();
        batch.extend(self.rest.drain(..rest));
        batch
    }
}

fn write_batches(store: &Store, inbox: &mpsc::Receiver<Request>, recorder: &Recorder) {
    let mut queued = Queued::default();
    loop {
        if queued.is_empty() {
            match inbox.recv() {
                Ok(request) => queued.push(request),
                Err(_) => return,
            }
        }
        while let Ok(request) = inbox.try_recv() {
            queued.push(request);
        }
        let mut batch = queued.next_batch(MAX_BATCH);
        // A change whose session is gone (cut at a shutdown's grace, or its connection died) is
        // left, as a crash would leave it: its node sends its events and answers again in its
        // next session. A shutdown then waits for no backlog of changes nobody reads.
        batch.retain(|(_, answer)| !answer.is_closed());
        if batch.is_empty() {
            continue;
        }
        let (changes, answers): (Vec<Change>, Vec<_>) = batch.into_iter().unzip();
        let started = Instant::now();
        let applied = apply_through_outages(store, &changes);
        recorder.commit(store.kind(), changes.len(), started.elapsed());
        for (answer, applied) in answers.into_iter().zip(applied) {
            let _ = answer.send(applied);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{KEEP_FINAL_RUNS, RedbBackend, TokenRecord};
    use fleet_proto::NodeId;
    use fleet_proto::version::ProtocolVersion;

    fn open_session(node_id: &NodeId) -> Change {
        Change::OpenSession {
            node_id: node_id.clone(),
            lease_until_ms: 60_000,
            at: None,
            protocol: ProtocolVersion::CURRENT,
        }
    }

    #[test]
    fn session_opens_go_before_the_changes_queued_ahead_of_them() {
        let request = |change| (change, oneshot::channel().0);
        let mut queued = Queued::default();
        queued.push(request(Change::Beats(Vec::new())));
        queued.push(request(Change::Beats(Vec::new())));
        queued.push(request(open_session(&NodeId::new("n-a"))));
        queued.push(request(open_session(&NodeId::new("n-b"))));
        let opened = |batch: &[Request]| -> Vec<Option<String>> {
            let node = |c: &Change| match c {
                Change::OpenSession { node_id, .. } => Some(node_id.to_string()),
                _ => None,
            };
            batch.iter().map(|(c, _)| node(c)).collect()
        };
        let first = queued.next_batch(3);
        let (a, b) = (Some("n-a".to_string()), Some("n-b".to_string()));
        assert_eq!(
            opened(&first),
            [a, b, None],
            "both opens, in order, then the oldest other"
        );
        assert_eq!(opened(&queued.next_batch(3)), [None]);
        assert!(queued.is_empty());
    }

    #[test]
    fn a_change_no_session_waits_for_any_more_is_left() {
        let dir = tempfile::tempdir().unwrap();
        let backend = RedbBackend::open(&dir.path().join("store.redb")).unwrap();
        let store = Arc::new(Store::open(Box::new(backend), KEEP_FINAL_RUNS).unwrap());
        let token = TokenRecord {
            expires_at_ms: u64::MAX,
            name: None,
            labels: Default::default(),
            spent_by: None,
            bootstrap_failure: None,
        };
        let node = NodeId::new("n-a");
        store.add_token("hash", &token, 0).unwrap();
        let joined = store.redeem("hash", "ed25519:key-a", &node, 1, 1_000);
        assert!(joined.unwrap().is_some());
        let committer = Committer::start(store, Recorder::default());
        // Its session was cut before the writer took it.
        let (answer, answered) = oneshot::channel();
        drop(answered);
        let requests = committer.requests.as_ref().unwrap();
        requests.send((open_session(&node), answer)).unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let applied = runtime.block_on(committer.submit(open_session(&node)));
        assert_eq!(applied.unwrap(), Applied::Generation(1));
    }
}
