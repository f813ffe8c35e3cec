//! Artifact tickets: a read of one digest by one node, once, for [`TICKET_VALID`]; minted for a
//! `replicate` and held in memory only.
use super::guarded::Guarded;
use fleet_proto::{Digest, NodeId};
use rand::RngCore;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// How long a minted ticket stays usable.
pub(crate) const TICKET_VALID: Duration = Duration::from_secs(60);

#[derive(Default)]
pub(crate) struct Tickets {
    minted: Guarded<HashMap<String, Ticket>>,
}

/// What a ticket lets one node read once, until when.
struct Ticket {
    node_id: NodeId,
    digest: Digest,
    until: Instant,
}

/// Why a ticket was not honoured; the node is told this line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TicketRefusal {
    #[error("the ticket for {0} is spent or unknown: a ticket reads once; mint a new one")]
    Unknown(Digest),
    #[error("the ticket was minted for another node or content than {0}; mint one for this fetch")]
    Mismatch(Digest),
    #[error("the ticket for {0} expired; mint a new one")]
    Expired(Digest),
}

impl Tickets {
    /// A fresh ticket for `node_id` to read `digest` once within [`TICKET_VALID`].
    pub(crate) fn mint(&self, node_id: &NodeId, digest: &Digest) -> String {
        self.mint_valid_for(node_id, digest, TICKET_VALID)
    }

    fn mint_valid_for(&self, node_id: &NodeId, digest: &Digest, valid: Duration) -> String {
        let mut raw = [0u8; 32];
        rand::thread_rng().fill_bytes(&mut raw);
        let ticket = hex::encode(raw);
        let minted = Ticket {
            node_id: node_id.clone(),
            digest: *digest,
            until: Instant::now() + valid,
        };
        let mut all = self.minted.lock();
        // Tickets nobody used go once expired: memory follows the tickets still usable.
        let now = Instant::now();
        all.retain(|_, t| t.until > now);
        all.insert(ticket.clone(), minted);
        ticket
    }

    /// Spends a ticket: Ok when it reads `digest` for `node_id` and has not expired; it is gone
    /// either way.
    pub(crate) fn spend(
        &self,
        ticket: &str,
        node_id: &NodeId,
        digest: &Digest,
    ) -> Result<(), TicketRefusal> {
        match self.minted.lock().remove(ticket) {
            None => Err(TicketRefusal::Unknown(*digest)),
            Some(t) if &t.node_id != node_id || t.digest != *digest => {
                Err(TicketRefusal::Mismatch(*digest))
            }
            Some(t) if Instant::now() >= t.until => Err(TicketRefusal::Expired(*digest)),
            Some(_) => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ticket_reads_once_for_its_node_and_content_until_it_expires() {
        let tickets = Tickets::default();
        let (n1, n2) = (NodeId::new("n-1"), NodeId::new("n-2"));
        let digest = Digest::of_reader(&b"artifact"[..]).unwrap();
        let other = Digest::of_reader(&b"other"[..]).unwrap();
        let t1 = tickets.mint(&n1, &digest);
        assert_eq!(tickets.spend(&t1, &n1, &digest), Ok(()));
        assert_eq!(
            tickets.spend(&t1, &n1, &digest).unwrap_err().to_string(),
            format!(
                "the ticket for {digest} is spent or unknown: a ticket reads once; mint a new one"
            )
        );
        let t2 = tickets.mint_valid_for(&n1, &digest, Duration::ZERO);
        assert_eq!(
            tickets.spend(&t2, &n1, &digest).unwrap_err().to_string(),
            format!("the ticket for {digest} expired; mint a new one")
        );
        let t3 = tickets.mint(&n1, &digest);
        assert_eq!(
            tickets.spend(&t3, &n1, &other).unwrap_err().to_string(),
            format!(
                "the ticket was minted for another node or content than {other}; mint one for this fetch"
            )
        );
        let t4 = tickets.mint(&n1, &digest);
        assert_eq!(
            tickets.spend(&t4, &n2, &digest),
            Err(TicketRefusal::Mismatch(digest)),
            "another node cannot spend it"
        );
    }

    #[test]
    fn expired_tickets_nobody_spent_are_not_kept() {
        let tickets = Tickets::default();
        let n1 = NodeId::new("n-1");
        let digest = Digest::of_reader(&b"artifact"[..]).unwrap();
        for _ in 0..100 {
            tickets.mint_valid_for(&n1, &digest, Duration::ZERO);
        }
        tickets.mint(&n1, &digest);
        assert_eq!(tickets.minted.lock().len(), 1);
    }
}
