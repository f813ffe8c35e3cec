//! Collects under way: the upload name each `collect` minted, the node that may send it, where
//! it lands, and a lock held while one try is received (a resumed try waits for the cut one).
use super::guarded::Guarded;
use fleet_content::Place;
use fleet_proto::{NodeId, UploadId};
use std::collections::HashMap;
use std::sync::Arc;

/// Held while one try of an upload is received.
pub(crate) type UploadLock = Arc<tokio::sync::Mutex<()>>;

#[derive(Default)]
pub(crate) struct Uploads {
    expected: Guarded<HashMap<UploadId, Expected>>,
}

/// An upload a collect under way waits for.
struct Expected {
    from: NodeId,
    place: Place,
    lock: UploadLock,
}

/// An upload expected from one node, for as long as this lives: dropped, whether the collect
/// was answered, failed or cancelled, the name is no longer accepted.
pub(crate) struct UploadExpected<'a> {
    uploads: &'a Uploads,
    name: UploadId,
}

impl Drop for UploadExpected<'_> {
    fn drop(&mut self) {
        self.uploads.expected.lock().remove(&self.name);
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum UploadRefusal {
    #[error("no collect under way expects upload {0} from this node; collect it again")]
    NotExpected(UploadId),
}

impl Uploads {
    /// Expects `name` from `node_id`, to land as `place`, until the returned guard is dropped.
    pub(crate) fn expect(
        &self,
        name: &UploadId,
        node_id: &NodeId,
        place: Place,
    ) -> UploadExpected<'_> {
        let expected = Expected {
            from: node_id.clone(),
            place,
            lock: UploadLock::default(),
        };
        (self.expected.lock()).insert(name.clone(), expected);
        UploadExpected {
            uploads: self,
            name: name.clone(),
        }
    }

    /// The lock of `name` and where it lands, when a collect under way expects it from
    /// `node_id`.
    pub(crate) fn expected(
        &self,
        name: &UploadId,
        node_id: &NodeId,
    ) -> Result<(UploadLock, Place), UploadRefusal> {
        match self.expected.lock().get(name) {
            Some(e) if e.from == *node_id => Ok((e.lock.clone(), e.place.clone())),
            _ => Err(UploadRefusal::NotExpected(name.clone())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_upload_is_expected_from_its_node_only_while_its_collect_lasts() {
        let uploads = Uploads::default();
        let (u1, n1, n2) = (UploadId::new("u1"), NodeId::new("n-1"), NodeId::new("n-2"));
        let collect = uploads.expect(&u1, &n1, Place::Blob);
        assert!(uploads.expected(&u1, &n1).is_ok());
        assert_eq!(
            uploads.expected(&u1, &n2).unwrap_err().to_string(),
            "no collect under way expects upload u1 from this node; collect it again"
        );
        drop(collect);
        assert_eq!(
            uploads.expected(&u1, &n1).unwrap_err(),
            UploadRefusal::NotExpected(u1)
        );
    }
}
