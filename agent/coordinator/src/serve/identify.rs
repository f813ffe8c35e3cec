//! Who is calling: a session or content connection belongs to a known node only when its
//! certificate carries the key that node joined with, and never to a node the operator ended.
use crate::Coordinator;
use crate::error::Dropped;
use crate::store::NodeRecord;
use fleet_proto::NodeId;
use fleet_proto::pin::{self, CertInfo};
use fleet_proto::protocol::NodeEnd;

/// A session or content connection is a known node's only when its certificate carries the
/// key that node joined with; answers the node's record.
pub(super) async fn known_node(
    coordinator: &Coordinator,
    cert: &CertInfo,
    node_id: &NodeId,
) -> Result<NodeRecord, Dropped> {
    let id = node_id.clone();
    let node = coordinator
        .with_store(move |store| store.node(&id))
        .await?
        .ok_or_else(|| {
            Dropped::NotAllowed(format!("a connection for an unknown node {node_id}"))
        })?;
    if node.public_key != pin::key_text(&cert.key) {
        return Err(Dropped::NotAllowed(format!(
            "a connection for {node_id} from another key"
        )));
    }
    Ok(node)
}

/// Why a connection of an ended node is dropped, for the coordinator's log.
pub(super) fn ended(node_id: &NodeId, end: NodeEnd) -> Dropped {
    Dropped::NotAllowed(format!(
        "a connection for {node_id}, which the operator {}",
        end.as_str()
    ))
}
