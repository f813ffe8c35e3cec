//! Heartbeats heard and not written yet: the newest of each node, written for the whole fleet in
//! one change a second, apart from the group commit's queue.
use super::guarded::Guarded;
use crate::store::Beat;
use fleet_proto::NodeId;
use fleet_proto::clock::now_ms;
use std::collections::HashMap;
use std::sync::Arc;

/// Cloned into each session's reader, which notes a heartbeat as it is read.
#[derive(Clone, Default)]
pub(crate) struct Beats(Arc<Guarded<HashMap<NodeId, Beat>>>);

impl Beats {
    /// A heartbeat of `node_id` heard now, extending its lease by `lease_ms`.
    pub(crate) fn note(&self, node_id: &NodeId, lease_ms: u64) {
        let beat = beat_now(node_id, lease_ms);
        self.0.lock().insert(beat.node_id.clone(), beat);
    }

    /// Every heartbeat noted since the last take.
    pub(crate) fn take(&self) -> Vec<Beat> {
        std::mem::take(&mut *self.0.lock()).into_values().collect()
    }

    /// Puts back heartbeats whose write failed, under any newer one heard meanwhile.
    pub(crate) fn restore(&self, beats: Vec<Beat>) {
        let mut waiting = self.0.lock();
        for beat in beats {
            waiting.entry(beat.node_id.clone()).or_insert(beat);
        }
    }
}

/// A heartbeat heard now, and the lease it extends.
pub(crate) fn beat_now(node_id: &NodeId, lease_ms: u64) -> Beat {
    let now = now_ms();
    Beat {
        node_id: node_id.clone(),
        at_ms: Some(now),
        lease_until_ms: now + lease_ms,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_write_is_restored_under_a_newer_beat() {
        let beats = Beats::default();
        let (n1, n2) = (NodeId::new("n-1"), NodeId::new("n-2"));
        beats.note(&n1, 1000);
        beats.note(&n2, 1000);
        let failed = beats.take();
        assert_eq!(failed.len(), 2);
        assert!(beats.take().is_empty(), "taken beats are gone");
        beats.note(&n1, 60_000);
        beats.restore(failed);
        let mut kept = beats.take();
        kept.sort_by(|a, b| a.node_id.cmp(&b.node_id));
        assert_eq!(kept.len(), 2);
        assert!(
            kept[0].lease_until_ms >= kept[0].at_ms.unwrap() + 60_000,
            "the newer beat of n-1 stays: {:?}",
            kept[0]
        );
        assert_eq!(kept[1].node_id, n2);
    }
}
