//! `fleet-loadgen --flood`: joins with a wrong token, `--rate` connections a second spread over
//! `--sources` loopback source addresses (127.0.X.Y, all of 127.0.0.0/8 being loopback on Linux),
//! each one the real pinned TLS handshake with one throwaway node key and an `Up::Join` whose
//! token the coordinator never minted. It counts how each attempt ended and prints one JSON line
//! of counters a second, as the simulated nodes do.
//!
//! What each attempt costs this process is kept small: one key, one certificate and one TLS
//! configuration for all of them, and a connection first waits [`CLOSED_AT_ACCEPT_WAIT`] for the
//! coordinator to close it before any TLS work: a coordinator refusing a source closes at
//! accept, so such an attempt costs a socket, a connect and a close on both sides, whatever the
//! client would have sent. Every connection ends with a reset (`SO_LINGER` 0), so 10 000 a
//! second leave no TIME_WAIT behind on either side.
use anyhow::{Context, Result};
use fleet_proto::joinfile::{JoinFile, Secret, TOKEN_PREFIX};
use fleet_proto::pin;
use fleet_proto::protocol::{self, Down, Opening, Up};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::{TcpSocket, TcpStream};

/// How long a fresh connection waits for the coordinator to close it (refused at accept) before
/// the TLS handshake starts; a connection the coordinator serves is only this much later.
const CLOSED_AT_ACCEPT_WAIT: Duration = Duration::from_millis(20);
/// Connect, handshake and answer each get this long.
const STEP_TIMEOUT: Duration = Duration::from_secs(5);
/// Attempts are started in batches this often, as many as are due.
const BATCH_EVERY: Duration = Duration::from_millis(5);
/// Distinct error texts printed to stderr at most (the counters count them all).
const ERRORS_PRINTED: usize = 20;

/// What the flood is told.
pub struct Flood {
    pub rate: u32,
    pub sources: u32,
    pub concurrency: usize,
    pub duration: Duration,
}

/// How the attempts ended, so far; printed once a second.
#[derive(Default)]
struct Counters {
    /// Connections started.
    attempts: AtomicU64,
    /// Attempts due that were not started: `--flood-concurrency` were still open.
    skipped: AtomicU64,
    /// Closed by the coordinator before or during the TLS handshake.
    refused_at_accept: AtomicU64,
    /// Handshake done, join sent, then closed by the coordinator without an answer.
    closed_after_join: AtomicU64,
    /// Answered `joined` (a wrong token should never be).
    joined: AtomicU64,
    /// Anything else: a connect that failed or timed out, a handshake or answer that timed out.
    errors: AtomicU64,
    /// Of the errors, connects that failed or timed out.
    connect_errors: AtomicU64,
    /// Open now.
    open: AtomicU64,
}

impl Counters {
    fn line(&self, since: Instant) -> String {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        serde_json::json!({
            "elapsed_ms": since.elapsed().as_millis() as u64,
            "attempts": get(&self.attempts),
            "skipped": get(&self.skipped),
            "refused_at_accept": get(&self.refused_at_accept),
            "closed_after_join": get(&self.closed_after_join),
            "joined": get(&self.joined),
            "errors": get(&self.errors),
            "connect_errors": get(&self.connect_errors),
            "open": get(&self.open),
        })
        .to_string()
    }
}

/// One attempt's end.
enum Ended {
    RefusedAtAccept,
    ClosedAfterJoin,
    Joined,
    ConnectFailed(String),
    Failed(String),
}

/// What every attempt shares.
struct Target {
    address: SocketAddr,
    tls: tokio_rustls::TlsConnector,
    join: Opening,
}

/// Source address `i` of the flood: 127.0.1.1, 127.0.1.2, ... 127.0.1.254, 127.0.2.1, ...
/// (127.0.0.1, where a machine's agent dials from, is never one of them).
pub fn source(i: u32) -> IpAddr {
    let (x, y) = (1 + i / 254, 1 + i % 254);
    IpAddr::V4(Ipv4Addr::new(127, 0, x.min(255) as u8, y as u8))
}

/// Floods the coordinator the first join file names until `flood.duration` has passed.
pub async fn run(join: &JoinFile, flood: Flood) -> Result<()> {
    let address: SocketAddr = tokio::net::lookup_host(&join.address)
        .await
        .with_context(|| format!("cannot resolve {}", join.address))?
        .next()
        .with_context(|| format!("{} resolves to nothing", join.address))?;
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ED25519)?;
    let cert = pin::mint_cert(&key, Duration::from_secs(86_400))?;
    let seen = Arc::new(Mutex::new(None));
    let config = pin::client_config(&key, cert, join.pinned_key(), seen)?;
    // Well formed, and never minted: 43 characters no random token is.
    let wrong = format!("{TOKEN_PREFIX}{}", "0".repeat(43));
    let target = Arc::new(Target {
        address,
        tls: tokio_rustls::TlsConnector::from(config),
        join: Opening::new(Up::Join {
            token: Secret(wrong),
            name: Some("flood".into()),
            labels: Default::default(),
        }),
    });
    let counters = Arc::new(Counters::default());
    let open = Arc::new(tokio::sync::Semaphore::new(flood.concurrency.max(1)));
    let printed = Arc::new(Mutex::new(std::collections::HashSet::<String>::new()));
    let since = Instant::now();
    let deadline = tokio::time::Instant::now() + flood.duration;

    let printer = {
        let counters = counters.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            tick.tick().await;
            loop {
                tick.tick().await;
                println!("{}", counters.line(since));
            }
        })
    };
    let mut batch = tokio::time::interval(BATCH_EVERY);
    batch.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let (mut due_total, mut next_source) = (0u64, 0u32);
    while tokio::time::Instant::now() < deadline {
        batch.tick().await;
        let due = (since.elapsed().as_secs_f64() * flood.rate as f64) as u64;
        for _ in due_total..due {
            let Ok(permit) = open.clone().try_acquire_owned() else {
                counters.skipped.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            let from = source(next_source % flood.sources.max(1));
            next_source = next_source.wrapping_add(1);
            counters.attempts.fetch_add(1, Ordering::Relaxed);
            let (target, counters, printed) = (target.clone(), counters.clone(), printed.clone());
            tokio::spawn(async move {
                counters.open.fetch_add(1, Ordering::Relaxed);
                let ended = attempt(&target, from).await;
                counters.open.fetch_sub(1, Ordering::Relaxed);
                drop(permit);
                let counter = match &ended {
                    Ended::RefusedAtAccept => &counters.refused_at_accept,
                    Ended::ClosedAfterJoin => &counters.closed_after_join,
                    Ended::Joined => &counters.joined,
                    Ended::ConnectFailed(_) => {
                        counters.connect_errors.fetch_add(1, Ordering::Relaxed);
                        &counters.errors
                    }
                    Ended::Failed(_) => &counters.errors,
                };
                counter.fetch_add(1, Ordering::Relaxed);
                if let Ended::ConnectFailed(e) | Ended::Failed(e) = ended {
                    let mut printed = printed.lock().unwrap_or_else(|p| p.into_inner());
                    if printed.len() < ERRORS_PRINTED && printed.insert(e.clone()) {
                        eprintln!("a flood attempt from {from} failed: {e}");
                    }
                }
            });
        }
        due_total = due;
    }
    // What is still open gets a moment to end, then the last line.
    let _ = tokio::time::timeout(
        STEP_TIMEOUT,
        open.acquire_many(flood.concurrency.max(1) as u32),
    )
    .await;
    printer.abort();
    println!("{}", counters.line(since));
    Ok(())
}

/// One connection from `from`: refused at accept, or a handshake and a join with a wrong token.
async fn attempt(target: &Target, from: IpAddr) -> Ended {
    let connected = async {
        let socket = TcpSocket::new_v4()?;
        // Closed with a reset, as a flooder would: neither side keeps the connection in
        // TIME_WAIT, nor a host's connection tracking for two minutes.
        socket.set_zero_linger()?;
        socket.bind(SocketAddr::new(from, 0))?;
        socket.connect(target.address).await
    };
    let stream = match tokio::time::timeout(STEP_TIMEOUT, connected).await {
        Ok(Ok(stream)) => stream,
        Ok(Err(e)) => return Ended::ConnectFailed(e.to_string()),
        Err(_) => return Ended::ConnectFailed("connect timed out".into()),
    };
    let _ = stream.set_nodelay(true);
    if closed_at_accept(&stream).await {
        return Ended::RefusedAtAccept;
    }
    let handshake = target.tls.connect(pin::server_name(), stream);
    let mut tls = match tokio::time::timeout(STEP_TIMEOUT, handshake).await {
        Ok(Ok(tls)) => tls,
        // Closed (or reset) before the server's flight: the coordinator refused it at accept.
        Ok(Err(_)) => return Ended::RefusedAtAccept,
        Err(_) => return Ended::Failed("the TLS handshake timed out".into()),
    };
    if let Err(e) = protocol::write_msg(&mut tls, &target.join).await {
        return Ended::Failed(format!("cannot send the join: {e}"));
    }
    let answer = protocol::read_msg::<_, Down>(&mut tls);
    match tokio::time::timeout(STEP_TIMEOUT, answer).await {
        Ok(Ok(None)) | Ok(Err(_)) => Ended::ClosedAfterJoin,
        Ok(Ok(Some(Down::Joined { .. }))) => Ended::Joined,
        Ok(Ok(Some(other))) => Ended::Failed(format!("answered {other:?}")),
        Err(_) => Ended::Failed("no answer to the join and no close".into()),
    }
}

/// Whether the coordinator closed (or reset) the connection within [`CLOSED_AT_ACCEPT_WAIT`]
/// of it being made, before anything was sent on it.
async fn closed_at_accept(stream: &TcpStream) -> bool {
    let mut byte = [0u8; 1];
    match tokio::time::timeout(CLOSED_AT_ACCEPT_WAIT, stream.peek(&mut byte)).await {
        Ok(Ok(0)) | Ok(Err(_)) => true,
        // A server speaks second: any byte here is the next step's to find odd.
        Ok(Ok(_)) | Err(_) => false,
    }
}
