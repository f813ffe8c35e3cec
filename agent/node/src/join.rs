//! The agent's side of the join: send the one-time token inside the pinned TLS session, retry
//! with capped backoff (a lost answer is answered again for the same key), give up once the token
//! cannot be valid any more.
use crate::backoff::Backoff;
use crate::dial::{self, DialError};
use crate::identity::Identity;
use fleet_proto::clock::now_ms;
use fleet_proto::joinfile::JoinFile;
use fleet_proto::protocol::{self, Down, Opening, Up};
use fleet_proto::version::Incompatible;
use std::time::Duration;

/// The join connection's certificate only needs to outlive one exchange.
const JOIN_CERT_VALIDITY: Duration = Duration::from_secs(300);
const ANSWER_TIMEOUT: Duration = Duration::from_secs(15);

#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    #[error(
        "the coordinator did not accept the join token in the {} it was minted for (it is spent, expired or unknown to it): mint a new join file with `fleet-coordinator token`",
        fleet_cli::duration::human(*.0)
    )]
    Expired(Duration),
    #[error(transparent)]
    Dial(#[from] DialError),
}

/// Joins and returns the node id the coordinator gave this key.
pub async fn join(
    identity: &Identity,
    file: &JoinFile,
    retry_base: Duration,
) -> Result<fleet_proto::NodeId, JoinError> {
    let pinned = file.pinned_key();
    let mut backoff = Backoff::new(retry_base);
    warn_of_skew(file);
    // Expiry is the coordinator's to judge, on its clock; the agent only bounds how long it
    // tries, by the token's lifetime on its own monotonic clock.
    let ttl = file.ttl_ms.map(Duration::from_millis);
    let tried_since = tokio::time::Instant::now();
    let addresses = file.addresses();
    for attempt in 1u64.. {
        // Each attempt goes to the next coordinator the file names: any of them answers a join.
        let address = &addresses[(attempt as usize - 1) % addresses.len()];
        if let Some(ttl) = ttl
            && tried_since.elapsed() >= ttl
        {
            return Err(JoinError::Expired(ttl));
        }
        let failure = match attempt_once(identity, file, address, &pinned).await {
            Ok(node_id) => return Ok(node_id),
            Err(Failure::Dial(e)) if e.is_fatal() => return Err(e.into()),
            Err(failure) => failure,
        };
        let delay = backoff.next_delay();
        tracing::warn!(
            attempt,
            %address,
            retry_in_ms = delay.as_millis() as u64,
            "join attempt failed: {failure}; retrying"
        );
        tokio::time::sleep(delay).await;
    }
    unreachable!("the attempt counter does not run out")
}

/// Says once, naming the clock, when this machine's clock already reads the token as expired:
/// the join still goes ahead, since the coordinator's clock is the one that counts.
fn warn_of_skew(file: &JoinFile) {
    let (Some(expires), now) = (file.expires_at_ms, now_ms()) else {
        return;
    };
    if now >= expires {
        tracing::warn!(
            "this machine's clock reads {now} ms since the epoch, {} s past the join token's expiry by the coordinator's clock: this machine's clock may be wrong (sync it with NTP); joining anyway, the coordinator judges expiry",
            (now - expires) / 1000
        );
    }
}

#[derive(Debug, thiserror::Error)]
enum Failure {
    #[error(transparent)]
    Dial(DialError),
    #[error(
        "no answer from the coordinator (the connection closed: the token may be spent, expired or wrong, or the answer was lost)"
    )]
    NoAnswer,
    #[error("the coordinator answered with something other than joined")]
    Unexpected,
    #[error("the coordinator refused the join: {0}")]
    Incompatible(Incompatible),
}

async fn attempt_once(
    identity: &Identity,
    file: &JoinFile,
    address: &str,
    pinned: &[u8],
) -> Result<fleet_proto::NodeId, Failure> {
    let mut dialed = dial::dial(address, identity, pinned, JOIN_CERT_VALIDITY)
        .await
        .map_err(Failure::Dial)?;
    let request = Up::Join {
        token: file.token.clone(),
        name: file.name.clone(),
        labels: file.labels.clone(),
    };
    protocol::write_msg(&mut dialed.stream, &Opening::new(request))
        .await
        .map_err(|_| Failure::NoAnswer)?;
    let answer = tokio::time::timeout(
        ANSWER_TIMEOUT,
        protocol::read_msg::<_, Down>(&mut dialed.stream),
    )
    .await;
    match answer {
        Ok(Ok(Some(Down::Joined { node_id, .. }))) => Ok(node_id),
        Ok(Ok(Some(Down::Incompatible { versions }))) => Err(Failure::Incompatible(versions)),
        Ok(Ok(Some(_))) => Err(Failure::Unexpected),
        _ => Err(Failure::NoAnswer),
    }
}
