//! `coordinator serve`: one port for joins, sessions (TLS, first byte 0x16) and the bundle
//! download (plain HTTP). A refused request is answered by closing the connection, nothing more.
//! At most [`ServeConfig::max_connections`] connections are served at once (the rest wait in
//! the listen backlog); on shutdown every session is told to end, and connections get
//! [`ServeConfig::shutdown_grace`] to finish before they are cut.
mod background;
mod connections;
mod first;
mod identify;
mod link;

use crate::error::Dropped;
use crate::live::Admission;
use crate::{Coordinator, http};
use connections::Connections;
use fleet_cli::blocking::off_thread;
use fleet_proto::NodeId;
use fleet_proto::pin;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

const TLS_HANDSHAKE: u8 = 0x16;

#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// The `host:port` machines and the fleet's other coordinators reach this one at.
    pub advertise: String,
    pub bundles: PathBuf,
    /// How often agents send heartbeats.
    pub heartbeat: Duration,
    /// How long a node stays `Joined` without a heartbeat.
    pub lease: Duration,
    /// The longest session certificate accepted: agents must renew at least this often.
    pub max_session_validity: Duration,
    /// A run no node took within this long fails.
    pub waiting_timeout: Duration,
    /// Connections served at once; each holds an open file.
    pub max_connections: usize,
    /// Content imported through this coordinator is held by this many coordinators of the fleet
    /// (or all, when fewer serve) before `run` records the runs that need it.
    pub content_copies: usize,
    /// Nodes fetching a program because of a stage from this coordinator, at most, at once.
    pub fetch_window: usize,
    /// On shutdown, how long connections get to finish before they are cut.
    pub shutdown_grace: Duration,
}

/// How many leases the nodes of a coordinator that stops get, at least, to hold a session again
/// before their runs are judged lost: they dial it again first, and a fleet's worth of sessions
/// opens at a bounded rate.
const LEASES_THROUGH_A_STOP: u32 = 2;

/// The least time those nodes get, whatever the lease: Nomad's `failover_heartbeat_ttl` (5 min,
/// the TTL every node gets after its leader changes). On a busy machine the last of 10 000 nodes
/// was back 79 to 100 s after a stop, and a run judged lost then was a run lost for nothing; the
/// grace only delays judging a node that died during the stop.
const FAILOVER_GRACE: Duration = Duration::from_secs(300);

/// What the nodes of a coordinator that stops get to hold a session again, with `lease`.
fn failover_grace(lease: Duration) -> Duration {
    (lease * LEASES_THROUGH_A_STOP).max(FAILOVER_GRACE)
}

/// Leases written in one statement when a coordinator stops.
const LEASE_WRITE: usize = 1000;

/// Gives every node whose session is held here its [`failover_grace`] from now (never shortening
/// a lease); answers how many.
async fn lease_through_restart(
    coordinator: Arc<Coordinator>,
    held: Vec<NodeId>,
    lease: Duration,
) -> crate::store::StoreResult<usize> {
    let grace = failover_grace(lease);
    let lease_ms = grace.as_millis() as u64;
    let beats: Vec<_> = (held.iter())
        .map(|node_id| crate::live::beat_now(node_id, lease_ms))
        .collect();
    let nodes = beats.len();
    let started = std::time::Instant::now();
    coordinator
        .with_store_unqueued(move |store| {
            // In writes the size of a second's heartbeats (with one statement over 10 000 rows a
            // stop took a minute on PostgreSQL). Rows a commit held at that moment are tried again.
            for chunk in beats.chunks(LEASE_WRITE) {
                let mut left = store.write_leases(chunk)?;
                for _ in 0..5 {
                    if left.is_empty() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                    left = store.write_leases(&left)?;
                }
            }
            Ok(())
        })
        .await?;
    let elapsed_ms = started.elapsed().as_millis() as u64;
    tracing::info!(
        nodes,
        grace_s = grace.as_secs(),
        elapsed_ms,
        "the nodes held here have a failover grace to be back"
    );
    Ok(nodes)
}

/// Records in the store that this coordinator serves the fleet at `config.advertise`, before
/// it takes connections: a join file or a welcome minted anywhere from then on names it.
/// [`serve`] does it first when it was not done.
pub async fn announce(coordinator: &Arc<Coordinator>, config: &ServeConfig) -> std::io::Result<()> {
    coordinator
        .fleet()
        .serve_at(&config.advertise, config.lease);
    let (joined, lease) = (coordinator.clone(), config.lease);
    off_thread(move || background::join_fleet(&joined, lease))
        .await
        .map_err(|e| std::io::Error::other(e.to_string()))
}

/// Serves until `shutdown` resolves, then drains.
pub async fn serve(
    coordinator: Arc<Coordinator>,
    listener: TcpListener,
    config: ServeConfig,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let cert = pin::mint_cert(coordinator.key(), Duration::from_secs(10 * 365 * 86400))
        .map_err(std::io::Error::other)?;
    let tls = tokio_rustls::TlsAcceptor::from(
        pin::server_config(coordinator.key(), cert).map_err(std::io::Error::other)?,
    );
    let config = Arc::new(config);
    if coordinator.fleet().address().is_none() {
        announce(&coordinator, &config).await?;
    }
    coordinator.credentials().open(config.waiting_timeout);
    coordinator.fleet().hold_copies(config.content_copies);
    coordinator.fetch_window().open(config.fetch_window);
    let background = background::start(&coordinator, &config);
    let (stop, stopping) = tokio::sync::watch::channel(false);
    let mut connections = Connections::new(config.max_connections, coordinator.recorder().clone());
    tracing::info!(
        max_connections = config.max_connections,
        "accepting connections"
    );
    (coordinator.recorder()).serving_with(config.heartbeat, config.lease);
    coordinator.sessions().set_accepting(true);
    tokio::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            _ = &mut shutdown => break,
            permit = connections.permit() => permit,
        };
        let (stream, peer) = tokio::select! {
            _ = &mut shutdown => break,
            // A connection that ended is forgot now, and one whose task panicked logged now,
            // not at the next accept.
            () = connections.ended() => continue,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        // A source past its allowance of failed joins is closed before any TLS work.
        let admitted = coordinator.joins().admit(peer.ip());
        if admitted == Admission::Refused {
            drop(stream);
            continue;
        }
        let (coordinator, config, tls) = (coordinator.clone(), config.clone(), tls.clone());
        let stopping = stopping.clone();
        connections.spawn(permit, move || async move {
            let _ = stream.set_nodelay(true);
            let mut first = [0u8; 1];
            let peeked = stream.peek(&mut first);
            match tokio::time::timeout(first::FIRST_MESSAGE_TIMEOUT, peeked).await {
                Ok(Ok(1)) if first[0] == TLS_HANDSHAKE => {
                    let handled = first::handle_tls(
                        &coordinator,
                        &config,
                        tls,
                        stream,
                        peer,
                        admitted,
                        stopping,
                    );
                    match handled.await {
                        Ok(()) => {}
                        // This coordinator's own fault, not the other side's: an operator's matter.
                        Err(reason @ Dropped::Store(_)) => {
                            tracing::warn!(%peer, "closed a connection without serving it: {reason}");
                        }
                        Err(reason) => {
                            tracing::info!(%peer, "closed a connection without answering: {reason}");
                        }
                    }
                }
                // Rare and short: its own allocation, so it does not size every session's task.
                Ok(Ok(1)) => {
                    coordinator.joins().not_failed(peer.ip(), admitted);
                    Box::pin(http::handle(&coordinator, &config.bundles, stream)).await
                }
                _ => {}
            }
        });
    }
    // No new connection from here; sessions end, transfers get the grace to finish.
    drop(listener);
    coordinator.sessions().set_accepting(false);
    let sessions = coordinator.sessions().count();
    // Read before any session is told to stop: one that ends at once is still given its leases
    // (20 of 10 000 were not, read a moment later, and their runs were judged lost).
    let held = coordinator.sessions().held();
    let extended = tokio::spawn(lease_through_restart(
        coordinator.clone(),
        held,
        config.lease,
    ));
    let _ = stop.send(true);
    let drained = connections.drain(config.shutdown_grace).await;
    drop(background);
    // Out of the fleet at once, not a lease from now: another coordinator sweeps the runs.
    let address = config.advertise.clone();
    let leaving = std::time::Instant::now();
    let left = coordinator
        .with_store_unqueued(move |store| store.heard_coordinator(&address, 0))
        .await;
    tracing::info!(
        elapsed_ms = leaving.elapsed().as_millis() as u64,
        "left the fleet's membership"
    );
    if let Err(e) = left {
        tracing::warn!("cannot say in the store that this coordinator left the fleet: {e}");
    }
    match extended.await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => {
            tracing::warn!("cannot give the nodes held here a lease through the restart: {e}")
        }
        Err(e) => tracing::warn!(
            "giving the nodes held here a lease through the restart did not complete: {e}"
        ),
    }
    let (sent, received) = coordinator.traffic().totals();
    tracing::info!(
        open = drained.open,
        sessions,
        ended = drained.ended,
        cut = drained.cut,
        grace_ms = config.shutdown_grace.as_millis() as u64,
        content_sent_bytes = sent,
        content_received_bytes = received,
        "stopped serving: {} of {} connections ended within the grace, {} cut",
        drained.ended,
        drained.open,
        drained.cut
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_failover_grace_is_the_longer_of_two_leases_and_five_minutes() {
        assert_eq!(failover_grace(Duration::from_secs(30)), FAILOVER_GRACE);
        assert_eq!(
            failover_grace(Duration::from_secs(600)),
            Duration::from_secs(1200)
        );
    }
}
