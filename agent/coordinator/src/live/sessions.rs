//! The node sessions this coordinator holds: one handle per node, the newest session's. The rest
//! of the coordinator reaches a node through it (a call, a wake-up) and never holds it.
use super::guarded::Guarded;
use fleet_proto::NodeId;
use fleet_proto::protocol::{Answer, Command, NodeEnd};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::sync::{Notify, mpsc, oneshot, watch};

/// How a session is woken to look at its node's waiting runs, and told whether the node's
/// capacity changed since: a session whose node has no room skips a plain wake-up.
#[derive(Default)]
pub(crate) struct Wake {
    notify: Notify,
    capacity_changed: AtomicBool,
}

impl Wake {
    /// Resolves at the next wake-up (or at once, for one given meanwhile), with whether the
    /// node's capacity changed since the last.
    pub(crate) async fn woken(&self) -> bool {
        self.notify.notified().await;
        self.capacity_changed.swap(false, Ordering::SeqCst)
    }

    fn wake(&self) {
        self.notify.notify_one();
    }
}

/// A request to a node through its live session, answered with the command's result.
/// Boxed: the session's channel allocates its slots in blocks, which an idle session keeps.
pub(crate) type NodeCall = Box<(Command, oneshot::Sender<Answer>)>;

/// One node's live session, as the rest of the coordinator reaches it.
pub(crate) struct SessionHandle {
    generation: u64,
    /// The key the node's session certificate carried (checked against its record at open).
    key: Box<[u8]>,
    /// Commands for the node, answered through the session.
    calls: mpsc::Sender<NodeCall>,
    /// Woken when runs may wait for the node: the session then reads its own waiting runs.
    wake: Arc<Wake>,
    /// Set when the operator ends the node: the session tells it and ends.
    end: watch::Sender<Option<NodeEnd>>,
}

impl SessionHandle {
    /// The handle, and what its session watches for the node's end.
    pub(crate) fn new(
        generation: u64,
        key: &[u8],
        calls: mpsc::Sender<NodeCall>,
        wake: Arc<Wake>,
    ) -> (Self, watch::Receiver<Option<NodeEnd>>) {
        let (end, ending) = watch::channel(None);
        let handle = SessionHandle {
            generation,
            key: key.into(),
            calls,
            wake,
            end,
        };
        (handle, ending)
    }
}

#[derive(Default)]
pub(crate) struct Sessions {
    by_node: Guarded<HashMap<NodeId, SessionHandle>>,
    /// Whether `serve` takes new sessions now: from its first accept until its drain.
    accepting: std::sync::atomic::AtomicBool,
    /// Sessions opened here since the start: a step that only new sessions can change (a done
    /// rollout) is taken only when this moved.
    opened: std::sync::atomic::AtomicU64,
}

/// A session's place in [`Sessions`], given up when dropped, whichever way the session ended,
/// unless a newer session of the same node took it meanwhile.
pub(crate) struct Registered<'a> {
    sessions: &'a Sessions,
    node_id: NodeId,
    generation: u64,
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        let mut by_node = self.sessions.by_node.lock();
        if (by_node.get(&self.node_id)).is_some_and(|s| s.generation == self.generation) {
            by_node.remove(&self.node_id);
        }
    }
}

impl Sessions {
    /// Makes `handle` the way to reach `node_id`, in place of any older session of it.
    pub(crate) fn register(&self, node_id: &NodeId, handle: SessionHandle) -> Registered<'_> {
        let generation = handle.generation;
        self.by_node.lock().insert(node_id.clone(), handle);
        (self.opened).fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Registered {
            sessions: self,
            node_id: node_id.clone(),
            generation,
        }
    }

    /// How many sessions were opened here since the start.
    pub(crate) fn opened(&self) -> u64 {
        self.opened.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Wakes the sessions held here of the nodes named; the others are not this coordinator's.
    pub(crate) fn wake<'a>(&self, nodes: impl IntoIterator<Item = &'a NodeId>) {
        let by_node = self.by_node.lock();
        for node in nodes {
            if let Some(session) = by_node.get(node) {
                session.wake.wake();
            }
        }
    }

    /// Tells the node's session held here, if any, that the operator changed its capacity: it
    /// looks at its runs again even if it had no room.
    pub(crate) fn capacity_changed(&self, node_id: &NodeId) {
        if let Some(session) = self.by_node.lock().get(node_id) {
            session.wake.capacity_changed.store(true, Ordering::SeqCst);
            session.wake.wake();
        }
    }

    /// Tells the node's session held here, if any, that the operator ended the node: it tells
    /// the node and ends.
    pub(crate) fn end(&self, node_id: &NodeId, end: NodeEnd) {
        if let Some(session) = self.by_node.lock().get(node_id) {
            session.end.send_replace(Some(end));
        }
    }

    /// The calls channel of the node's session, when this coordinator holds it.
    pub(crate) fn calls(&self, node_id: &NodeId) -> Option<mpsc::Sender<NodeCall>> {
        self.by_node.lock().get(node_id).map(|s| s.calls.clone())
    }

    pub(crate) fn holds(&self, node_id: &NodeId) -> bool {
        self.by_node.lock().contains_key(node_id)
    }

    /// Whether a session of `node_id` is held here, opened with `key`: the node is known, with
    /// that key, and was not ended when it opened (an end cuts it within [`crate::serve`]'s look).
    pub(crate) fn holds_with_key(&self, node_id: &NodeId, key: &[u8]) -> bool {
        (self.by_node.lock().get(node_id)).is_some_and(|s| *s.key == *key)
    }

    /// `serve` takes new sessions (true) or no longer does (false).
    pub(crate) fn set_accepting(&self, accepting: bool) {
        (self.accepting).store(accepting, std::sync::atomic::Ordering::SeqCst);
    }

    pub(crate) fn accepting(&self) -> bool {
        self.accepting.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The nodes whose session is held here now.
    pub(crate) fn held(&self) -> Vec<NodeId> {
        self.by_node.lock().keys().cloned().collect()
    }

    /// How many sessions are held here now.
    pub(crate) fn count(&self) -> usize {
        self.by_node.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handle(generation: u64) -> (SessionHandle, mpsc::Receiver<NodeCall>, Arc<Wake>) {
        let (calls, inbox) = mpsc::channel(1);
        let wake = Arc::new(Wake::default());
        let (handle, _) = SessionHandle::new(generation, b"key", calls, wake.clone());
        (handle, inbox, wake)
    }

    #[test]
    fn an_ended_session_leaves_a_newer_one_of_its_node_in_place() {
        let sessions = Sessions::default();
        let (first, _inbox1, _) = handle(1);
        let n1 = NodeId::new("n-1");
        let older = sessions.register(&n1, first);
        let (second, _inbox2, _) = handle(2);
        let newer = sessions.register(&n1, second);
        drop(older);
        assert!(sessions.holds(&n1), "the newer session stays");
        drop(newer);
        assert!(!sessions.holds(&n1));
        assert_eq!(sessions.count(), 0);
    }

    #[tokio::test]
    async fn only_the_named_nodes_held_here_are_woken() {
        let sessions = Sessions::default();
        let (one, _inbox, woken) = handle(1);
        let (n1, n2) = (NodeId::new("n-1"), NodeId::new("n-2"));
        let _held = sessions.register(&n1, one);
        sessions.wake([&n2, &n1]);
        let within = std::time::Duration::from_secs(5);
        let changed = tokio::time::timeout(within, woken.woken()).await;
        assert_eq!(changed, Ok(false), "n-1 is woken, its capacity unchanged");
        sessions.capacity_changed(&n1);
        let changed = tokio::time::timeout(within, woken.woken()).await;
        assert_eq!(changed, Ok(true), "n-1 is told its capacity changed");
        assert!(sessions.calls(&n1).is_some());
        assert!(sessions.calls(&n2).is_none());
        assert!(sessions.holds_with_key(&n1, b"key"));
        assert!(!sessions.holds_with_key(&n1, b"another key"));
        assert!(!sessions.holds_with_key(&n2, b"key"));
    }
}
