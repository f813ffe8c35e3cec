//! `fleet-loadgen`: many simulated nodes in one process, each speaking the real node protocol to a
//! coordinator: its own Ed25519 key, the pinned TLS join with a one-time token, a session with
//! facts and heartbeats at the coordinator's interval, and answers to commands (a start is
//! answered, then reported `running` and `finished` with exit 0, without running anything). A node
//! whose session ends reconnects as the agent does: with the agent's backoff, to the next
//! coordinator its join file names. It prints one JSON line of counters a second, for
//! `cargo xtask bench fleet`.
//!
//! With `--flood` it is a hostile client instead (see [`flood`]): joins with a wrong token,
//! `--rate` connections a second from `--sources` loopback addresses, for `cargo xtask bench flood`.
mod flood;

use anyhow::{Context, Result};
use clap::Parser;
use fleet_agent::identity::Identity;
use fleet_proto::facts::Facts;
use fleet_proto::joinfile::JoinFile;
use fleet_proto::protocol::{self, Command, Down, Refusal, RefusalClass, Reply, Up};
use fleet_proto::run::{Event, Outcome, RunReport, RunState};
use fleet_proto::{NodeId, OpId, RunId};
use std::io::BufRead;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::io::AsyncWrite;

#[derive(Parser)]
#[command(
    name = "fleet-loadgen",
    about = "Simulated nodes speaking the real node protocol"
)]
struct Args {
    /// Join files, one JSON object a line (`fleet-coordinator token --count N`): one node each
    #[arg(long)]
    join_files: std::path::PathBuf,
    /// Joins in flight at once
    #[arg(long, default_value_t = 64)]
    join_concurrency: usize,
    /// Stop after this long
    #[arg(long, default_value = "10m", value_parser = fleet_cli::duration::parse)]
    duration: Duration,
    /// Flood the coordinator the first join file names with joins carrying a wrong token (the
    /// real pinned TLS, one throwaway key) instead of simulating nodes
    #[arg(long)]
    flood: bool,
    /// With --flood: connections started a second
    #[arg(long, default_value_t = 10_000, requires = "flood")]
    rate: u32,
    /// With --flood: how many source addresses (127.0.1.1, 127.0.1.2, ...) the connections
    /// come from, in turn
    #[arg(long, default_value_t = 64, requires = "flood", value_parser = clap::value_parser!(u32).range(1..=60_000))]
    sources: u32,
    /// With --flood: connections open at once at most; an attempt due past it is skipped (and
    /// counted)
    #[arg(long, default_value_t = 4096, requires = "flood")]
    flood_concurrency: usize,
}

/// What the nodes did so far, printed once a second.
#[derive(Default)]
struct Counters {
    joined: AtomicU64,
    sessions: AtomicU64,
    /// Sessions open now.
    live: AtomicU64,
    heartbeats: AtomicU64,
    starts: AtomicU64,
    finished: AtomicU64,
    failures: AtomicU64,
}

impl Counters {
    fn line(&self, since: Instant) -> String {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        serde_json::json!({
            "elapsed_ms": since.elapsed().as_millis() as u64,
            "joined": get(&self.joined),
            "sessions": get(&self.sessions),
            "live": get(&self.live),
            "heartbeats": get(&self.heartbeats),
            "starts": get(&self.starts),
            "finished": get(&self.finished),
            "failures": get(&self.failures),
        })
        .to_string()
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    let file = std::fs::File::open(&args.join_files)
        .with_context(|| format!("cannot read {}", args.join_files.display()))?;
    let joins: Vec<JoinFile> = std::io::BufReader::new(file)
        .lines()
        .map(|line| Ok(serde_json::from_str(&line?)?))
        .collect::<Result<_>>()
        .context("the join files are not JSON lines of join files")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    if args.flood {
        let first = joins.first().context("the join files file is empty")?;
        let flood = flood::Flood {
            rate: args.rate,
            sources: args.sources,
            concurrency: args.flood_concurrency,
            duration: args.duration,
        };
        return runtime.block_on(flood::run(first, flood));
    }
    runtime.block_on(simulate(joins, &args))
}

async fn simulate(joins: Vec<JoinFile>, args: &Args) -> Result<()> {
    let counters = Arc::new(Counters::default());
    let joining = Arc::new(tokio::sync::Semaphore::new(args.join_concurrency));
    let since = Instant::now();
    for join in joins {
        let (counters, joining) = (counters.clone(), joining.clone());
        tokio::spawn(async move {
            if let Err(e) = node(join, &counters, &joining).await {
                counters.failures.fetch_add(1, Ordering::Relaxed);
                eprintln!("a simulated node stopped: {e:#}");
            }
        });
    }
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let deadline = tokio::time::Instant::now() + args.duration;
    while tokio::time::Instant::now() < deadline {
        tick.tick().await;
        println!("{}", counters.line(since));
    }
    Ok(())
}

/// One node: join once, then keep a session open, reconnecting when it ends.
async fn node(join: JoinFile, counters: &Counters, joining: &tokio::sync::Semaphore) -> Result<()> {
    let identity = Identity {
        key: rcgen::KeyPair::generate_for(&rcgen::PKCS_ED25519)?,
    };
    let node_id = {
        let _permit = joining.acquire().await?;
        fleet_agent::join::join(&identity, &join, Duration::from_millis(200)).await?
    };
    counters.joined.fetch_add(1, Ordering::Relaxed);
    let mut spool = Spool::default();
    let addresses = join.addresses();
    let mut backoff = fleet_agent::backoff::Backoff::new(Duration::from_millis(200));
    for attempt in 0usize.. {
        let address = &addresses[attempt % addresses.len()];
        let ended = session(&identity, &join, address, &node_id, &mut spool, counters).await;
        match ended {
            Ok(true) => backoff.reset(),
            Ok(false) => {}
            Err(e) => eprintln!("{node_id}: session at {address} ended: {e:#}"),
        }
        tokio::time::sleep(backoff.next_delay()).await;
    }
    Ok(())
}

/// One session at `address`; Ok(true) when it was open before it ended.
async fn session(
    identity: &Identity,
    join: &JoinFile,
    address: &str,
    node_id: &NodeId,
    spool: &mut Spool,
    counters: &Counters,
) -> Result<bool> {
    let dialed = fleet_agent::dial::dial(
        address,
        identity,
        &join.pinned_key(),
        Duration::from_secs(3600),
    )
    .await?;
    let mut stream = dialed.stream;
    let hello = Up::Hello {
        node_id: node_id.clone(),
    };
    protocol::write_msg(&mut stream, &hello).await?;
    let Some(Down::Welcome { heartbeat_ms, .. }) = protocol::read_msg(&mut stream).await? else {
        anyhow::bail!("no welcome");
    };
    counters.sessions.fetch_add(1, Ordering::Relaxed);
    counters.live.fetch_add(1, Ordering::Relaxed);
    let ended = open_session(stream, heartbeat_ms, spool, counters).await;
    counters.live.fetch_sub(1, Ordering::Relaxed);
    ended.map(|()| true)
}

async fn open_session<S: tokio::io::AsyncRead + AsyncWrite + Unpin + Send + 'static>(
    mut stream: S,
    heartbeat_ms: u64,
    spool: &mut Spool,
    counters: &Counters,
) -> Result<()> {
    protocol::write_msg(&mut stream, &Up::Facts { facts: facts() }).await?;
    // As the agent replays its spool: every event not acked yet, again.
    for event in &spool.unacked {
        let event = event.clone();
        protocol::write_msg(&mut stream, &Up::Event { event }).await?;
    }
    let (mut reader, mut writer) = tokio::io::split(stream);
    let (inbox_tx, mut inbox) = tokio::sync::mpsc::channel(16);
    // A reader task of its own: a read cancelled halfway through a frame would lose it.
    let reading = tokio::spawn(async move {
        loop {
            let msg = protocol::read_msg::<_, Down>(&mut reader).await;
            let end = !matches!(msg, Ok(Some(_)));
            if inbox_tx.send(msg).await.is_err() || end {
                return;
            }
        }
    });
    let mut heartbeat = tokio::time::interval(Duration::from_millis(heartbeat_ms.max(50)));
    let ended = loop {
        tokio::select! {
            _ = heartbeat.tick() => {
                if let Err(e) = protocol::write_msg(&mut writer, &Up::Heartbeat).await {
                    break Err(e.into());
                }
                counters.heartbeats.fetch_add(1, Ordering::Relaxed);
            }
            msg = inbox.recv() => match msg {
                Some(Ok(Some(Down::Command { op, command, .. }))) => {
                    if let Err(e) = answer(&mut writer, op, command, spool, counters).await {
                        break Err(e);
                    }
                }
                Some(Ok(Some(Down::Ack { up_to }))) => spool.unacked.retain(|e| e.id > up_to),
                Some(Ok(Some(_))) => {}
                Some(Err(e)) => break Err(e.into()),
                None | Some(Ok(None)) => break Ok(()),
            },
        }
    };
    reading.abort();
    ended
}

/// Answers one command as an agent would, a start with its two events after the answer.
async fn answer<W: AsyncWrite + Unpin>(
    writer: &mut W,
    op: OpId,
    command: Command,
    spool: &mut Spool,
    counters: &Counters,
) -> Result<()> {
    let (answer, started) = match command {
        Command::Stage { digest, .. } => (Ok(Reply::Staged { digest }), None),
        Command::Start(start) => {
            // A start sent again (its answer was lost) is answered from what the node did.
            let first = spool.started.insert(start.run_id.clone());
            if first {
                counters.starts.fetch_add(1, Ordering::Relaxed);
            }
            let reply = Reply::Started {
                run_id: start.run_id.clone(),
                already: !first,
            };
            (Ok(reply), first.then_some(start.run_id))
        }
        _ => (
            Err(Refusal::new(
                RefusalClass::Unsupported,
                "a simulated node only stages and starts",
            )),
            None,
        ),
    };
    protocol::write_msg(writer, &Up::Result { op, answer }).await?;
    if let Some(run_id) = started {
        for (state, outcome) in [
            (RunState::Running, None),
            (
                RunState::Finished,
                Some(Outcome {
                    exit_code: Some(0),
                    ..Outcome::default()
                }),
            ),
        ] {
            spool.next_id += 1;
            let event = Event {
                id: spool.next_id,
                run_id: run_id.clone(),
                state,
                report: RunReport {
                    outcome,
                    ..RunReport::default()
                },
                at_unix_ms: fleet_proto::clock::now_ms(),
            };
            spool.unacked.push(event.clone());
            protocol::write_msg(writer, &Up::Event { event }).await?;
        }
        counters.finished.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}

/// What a simulated node remembers across its sessions, as the agent's store does: the runs it
/// started, and the events the coordinator has not acked yet.
#[derive(Default)]
struct Spool {
    next_id: u64,
    started: std::collections::HashSet<RunId>,
    unacked: Vec<Event>,
}

fn facts() -> Facts {
    Facts {
        arch: std::env::consts::ARCH.to_string(),
        cpus: 2,
        memory_bytes: 24 << 30,
        disk_free_bytes: 100 << 30,
        kernel: "simulated".into(),
        os: "simulated".into(),
        agent_version: env!("CARGO_PKG_VERSION").to_string(),
        accelerators: Vec::new(),
        // No limit declared, as an agent from before capacities: every run is sent at once.
        max_runs: None,
        measured_link: None,
    }
}
