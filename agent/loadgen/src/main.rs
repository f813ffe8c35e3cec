//! `fleet-loadgen`: many simulated nodes in one process, each speaking the real node protocol to a
//! coordinator: its own Ed25519 key, the pinned TLS join with a one-time token, a session with
//! facts and heartbeats at the coordinator's interval, and answers to commands. A stage fetches
//! the program on the agent's own content path (`fleet_agent::content`: a pinned connection, the
//! bytes hashed as they land, once per node and digest); a start is answered, then reported
//! `running` and, `--run-ms` later, `finished` with exit 0, without running anything. A node
//! declares `--capacity` and counts every start beyond it. A node whose session ends reconnects
//! as the agent does: with the agent's backoff, to the next coordinator its join file names. It
//! prints one JSON line of counters a second, for `cargo xtask bench fleet`.
//!
//! With `--flood` it is a hostile client instead (see [`flood`]): joins with a wrong token,
//! `--rate` connections a second from `--sources` loopback addresses, for `cargo xtask bench flood`.
mod flood;

use anyhow::{Context, Result};
use clap::Parser;
use fleet_agent::content::ContentLink;
use fleet_agent::dial::{Coordinators, Dialed};
use fleet_agent::identity::Identity;
use fleet_content::Blobs;
use fleet_proto::facts::Facts;
use fleet_proto::joinfile::JoinFile;
use fleet_proto::protocol::{
    self, Answer, Command, Down, Opening, Refusal, RefusalClass, Reply, Up,
};
use fleet_proto::release::{ReleaseFacts, ReleaseOffer, UpdateOutcome};
use fleet_proto::run::{Event, Outcome, RunReport, RunState, Workload};
use fleet_proto::{Digest, NodeId, OpId, RunId};
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
    /// Runs at once each node declares (its `max_runs`); none declares no limit
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    capacity: Option<u32>,
    /// How long a run "runs" before it is reported finished
    #[arg(long, default_value_t = 0)]
    run_ms: u64,
    /// Where each node keeps the content it fetched (a folder per node)
    #[arg(long, default_value = "loadgen-blobs")]
    blobs: std::path::PathBuf,
}

/// How every simulated node behaves.
#[derive(Clone)]
struct Behaviour {
    capacity: Option<u32>,
    run_time: Duration,
    blobs: std::path::PathBuf,
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
    /// Programs fetched whole and checked.
    fetched: AtomicU64,
    /// Fetches that failed for good (after the content path's own tries).
    fetch_failures: AtomicU64,
    /// Starts that came while the node already ran as many runs as its capacity.
    over_capacity: AtomicU64,
    /// Releases taken (fetched and reported kept, without exec'ing anything).
    updated: AtomicU64,
    /// The bytes of release binaries fetched.
    update_bytes: AtomicU64,
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
            "fetched": get(&self.fetched),
            "fetch_failures": get(&self.fetch_failures),
            "over_capacity": get(&self.over_capacity),
            "updated": get(&self.updated),
            "update_bytes": get(&self.update_bytes),
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
    for (i, join) in joins.into_iter().enumerate() {
        let (counters, joining) = (counters.clone(), joining.clone());
        let behaviour = Behaviour {
            capacity: args.capacity,
            run_time: Duration::from_millis(args.run_ms),
            blobs: args.blobs.join(format!("node-{i}")),
        };
        tokio::spawn(async move {
            if let Err(e) = node(join, behaviour, &counters, &joining).await {
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
async fn node(
    join: JoinFile,
    behaviour: Behaviour,
    counters: &Counters,
    joining: &tokio::sync::Semaphore,
) -> Result<()> {
    let identity = Arc::new(Identity {
        key: rcgen::KeyPair::generate_for(&rcgen::PKCS_ED25519)?,
    });
    let node_id = {
        let _permit = joining.acquire().await?;
        fleet_agent::join::join(&identity, &join, Duration::from_millis(200)).await?
    };
    counters.joined.fetch_add(1, Ordering::Relaxed);
    let coordinators = Coordinators::new(join.addresses());
    let mut node = Sim {
        spool: Spool::default(),
        content: ContentLink {
            address: coordinators.clone(),
            node_id: node_id.clone(),
            identity: identity.clone(),
            pinned: join.pinned_key(),
            validity: Duration::from_secs(3600),
            blobs: Blobs::new(&behaviour.blobs),
        },
        release: ReleaseFacts {
            sequence: 0,
            update: None,
        },
        behaviour,
        running: 0,
        done: tokio::sync::mpsc::unbounded_channel(),
    };
    let mut backoff = fleet_agent::backoff::Backoff::new(Duration::from_millis(200));
    let mut home = None;
    loop {
        let address = coordinators.current();
        let ready = home.take();
        let ended = session(
            &identity,
            &join,
            &coordinators,
            &node_id,
            &mut node,
            counters,
            ready,
        );
        match ended.await {
            // As the agent does: back to the coordinator it joined through, over the connection
            // it welcomed the node on while the session elsewhere went on.
            Ok(Left::Home(greeted)) => {
                backoff.reset();
                coordinators.go_home();
                home = Some(*greeted);
                continue;
            }
            Ok(Left::Ended) => backoff.reset(),
            Ok(Left::Stopping) => {
                backoff.reset();
                coordinators.stopping();
            }
            Err(e) => eprintln!("{node_id}: session at {address} ended: {e:#}"),
        }
        tokio::time::sleep(coordinators.advance_after(&mut backoff)).await;
    }
}

/// How a session that did not fail ended.
enum Left {
    /// It was open, and the coordinator ended it.
    Ended,
    /// It was open, and the coordinator said it stops (a shutdown or a restart).
    Stopping,
    /// It was open away from home, and home welcomed the node on this connection.
    Home(Box<Greeted>),
}

/// A connection whose coordinator welcomed the node: what its session needs of the welcome.
struct Greeted {
    stream: tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
    heartbeat_ms: u64,
    lease_ms: u64,
}

/// Says hello on a new connection and reads the welcome.
async fn greet(dialed: Dialed, node_id: &NodeId) -> Result<Greeted> {
    let mut stream = dialed.stream;
    let hello = Up::Hello {
        node_id: node_id.clone(),
    };
    protocol::write_msg(&mut stream, &Opening::new(hello)).await?;
    let Some(Down::Welcome {
        heartbeat_ms,
        lease_ms,
        ..
    }) = protocol::read_msg(&mut stream).await?
    else {
        anyhow::bail!("no welcome");
    };
    Ok(Greeted {
        stream,
        heartbeat_ms,
        lease_ms,
    })
}

/// One session at the current coordinator, over `ready` when it welcomed the node already.
async fn session(
    identity: &Identity,
    join: &JoinFile,
    coordinators: &Coordinators,
    node_id: &NodeId,
    node: &mut Sim,
    counters: &Counters,
    ready: Option<Greeted>,
) -> Result<Left> {
    let pinned = join.pinned_key();
    let dial = |address: String| {
        let pinned = pinned.clone();
        async move {
            fleet_agent::dial::dial(&address, identity, &pinned, Duration::from_secs(3600)).await
        }
    };
    let greeted = match ready {
        Some(greeted) => greeted,
        None => greet(dial(coordinators.current()).await?, node_id).await?,
    };
    coordinators.welcomed(Duration::from_millis(greeted.lease_ms));
    counters.sessions.fetch_add(1, Ordering::Relaxed);
    counters.live.fetch_add(1, Ordering::Relaxed);
    // As the agent does: home is left for only once it has welcomed the node.
    let home = coordinators.dial_home(|home| {
        let dialed = dial(home);
        async move { greet(dialed.await?, node_id).await }
    });
    let ended = open_session(greeted.stream, greeted.heartbeat_ms, home, node, counters).await;
    counters.live.fetch_sub(1, Ordering::Relaxed);
    ended
}

async fn open_session<S: tokio::io::AsyncRead + AsyncWrite + Unpin + Send + 'static>(
    mut stream: S,
    heartbeat_ms: u64,
    home: impl std::future::Future<Output = Greeted>,
    node: &mut Sim,
    counters: &Counters,
) -> Result<Left> {
    let facts = facts(node.behaviour.capacity, &node.release);
    protocol::write_msg(&mut stream, &Up::Facts { facts }).await?;
    // As the agent replays its spool: every event not acked yet, again.
    for event in &node.spool.unacked {
        let event = event.clone();
        protocol::write_msg(&mut stream, &Up::Event { event }).await?;
    }
    let (mut reader, mut writer) = tokio::io::split(stream);
    let (inbox_tx, mut inbox) = tokio::sync::mpsc::channel(16);
    // As the agent does: a stop said is noted as it is read, whatever a write meets meanwhile.
    let said_stopping = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stopping = said_stopping.clone();
    // A reader task of its own: a read cancelled halfway through a frame would lose it.
    let reading = tokio::spawn(async move {
        loop {
            let msg = protocol::read_msg::<_, Down>(&mut reader).await;
            if let Ok(Some(Down::Stopping)) = msg {
                stopping.store(true, Ordering::SeqCst);
            }
            let end = !matches!(msg, Ok(Some(_)));
            if inbox_tx.send(msg).await.is_err() || end {
                return;
            }
        }
    });
    let mut heartbeat = tokio::time::interval(Duration::from_millis(heartbeat_ms.max(50)));
    tokio::pin!(home);
    let ended = loop {
        tokio::select! {
            greeted = &mut home => break Ok(Left::Home(Box::new(greeted))),
            _ = heartbeat.tick() => {
                if let Err(e) = protocol::write_msg(&mut writer, &Up::Heartbeat).await {
                    break Err(e.into());
                }
                counters.heartbeats.fetch_add(1, Ordering::Relaxed);
            }
            Some(run_id) = node.done.1.recv() => {
                if let Err(e) = node.finish(&mut writer, run_id, counters).await {
                    break Err(e);
                }
            }
            msg = inbox.recv() => match msg {
                Some(Ok(Some(Down::Command { op, command, .. }))) => {
                    if let Err(e) = node.answer(&mut writer, &mut heartbeat, op, command, counters).await {
                        break Err(e);
                    }
                }
                Some(Ok(Some(Down::Ack { up_to }))) => node.spool.unacked.retain(|e| e.id > up_to),
                Some(Ok(Some(Down::Stopping))) => break Ok(Left::Stopping),
                Some(Ok(Some(_))) => {}
                Some(Err(e)) => break Err(e.into()),
                None | Some(Ok(None)) => break Ok(Left::Ended),
            },
        }
    };
    reading.abort();
    match (said_stopping.load(Ordering::SeqCst), ended) {
        (true, Ok(Left::Home(greeted))) => Ok(Left::Home(greeted)),
        (true, _) => Ok(Left::Stopping),
        (false, ended) => ended,
    }
}

/// Awaits `work`, writing a heartbeat at each tick meanwhile.
async fn beating<T, W: AsyncWrite + Unpin>(
    work: impl std::future::Future<Output = T>,
    writer: &mut W,
    heartbeat: &mut tokio::time::Interval,
    counters: &Counters,
) -> Result<T> {
    tokio::pin!(work);
    loop {
        tokio::select! {
            done = &mut work => return Ok(done),
            _ = heartbeat.tick() => {
                protocol::write_msg(writer, &Up::Heartbeat).await?;
                counters.heartbeats.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// One simulated node across its sessions.
struct Sim {
    spool: Spool,
    /// The agent's own content path, into this node's folder.
    content: ContentLink,
    behaviour: Behaviour,
    /// Runs started and not reported finished yet.
    running: u32,
    /// The release it "runs": one it was sent is fetched and reported kept, nothing exec'd.
    release: ReleaseFacts,
    /// Runs whose time is up, to be reported finished (in whichever session is open then).
    done: (
        tokio::sync::mpsc::UnboundedSender<RunId>,
        tokio::sync::mpsc::UnboundedReceiver<RunId>,
    ),
}

impl Sim {
    /// Answers one command as an agent would: a stage fetches the program, a start is reported
    /// `running` after its answer and `finished` once its time is up. Heartbeats go on while a
    /// fetch waits, as the agent's do beside its commands.
    async fn answer<W: AsyncWrite + Unpin>(
        &mut self,
        writer: &mut W,
        heartbeat: &mut tokio::time::Interval,
        op: OpId,
        command: Command,
        counters: &Counters,
    ) -> Result<()> {
        let (answer, started) = match command {
            Command::Stage { digest } => {
                let fetched = self.fetch(&digest, counters);
                (beating(fetched, writer, heartbeat, counters).await?, None)
            }
            Command::Update { release } => {
                let taken = self.take(&release, counters);
                let answer = beating(taken, writer, heartbeat, counters).await?;
                protocol::write_msg(writer, &Up::Result { op, answer }).await?;
                let facts = facts(self.behaviour.capacity, &self.release);
                protocol::write_msg(writer, &Up::Facts { facts }).await?;
                return Ok(());
            }
            Command::Start(start) => {
                let program = match &start.workload {
                    Workload::Program(digest) => Some(*digest),
                    _ => None,
                };
                // A start sent again (its answer was lost) is answered from what the node did.
                let first = !self.spool.started.contains(&start.run_id);
                let fetched = match program {
                    Some(digest) if first => {
                        let fetched = self.fetch(&digest, counters);
                        beating(fetched, writer, heartbeat, counters)
                            .await?
                            .map(drop)
                    }
                    _ => Ok(()),
                };
                match fetched {
                    Err(refusal) => (Err(refusal), None),
                    Ok(()) => {
                        if first {
                            self.spool.started.insert(start.run_id.clone());
                            counters.starts.fetch_add(1, Ordering::Relaxed);
                            if self.behaviour.capacity.is_some_and(|c| self.running >= c) {
                                counters.over_capacity.fetch_add(1, Ordering::Relaxed);
                            }
                            self.running += 1;
                        }
                        let reply = Reply::Started {
                            run_id: start.run_id.clone(),
                            already: !first,
                        };
                        (Ok(reply), first.then_some(start.run_id))
                    }
                }
            }
            _ => (
                Err(Refusal::new(
                    RefusalClass::Unsupported,
                    "a simulated node only stages and starts",
                )),
                None,
            ),
        };
        // The run "runs" from here, as the agent's starts are durable before their answer: its
        // `running` event is kept and its end timed before anything is written, so a session
        // that breaks mid-write loses neither (the kept event is sent again in the next one).
        let running = started.map(|run_id| {
            let event = self.record(&run_id, RunState::Running, None);
            let (done, run_time) = (self.done.0.clone(), self.behaviour.run_time);
            tokio::spawn(async move {
                tokio::time::sleep(run_time).await;
                let _ = done.send(run_id);
            });
            event
        });
        protocol::write_msg(writer, &Up::Result { op, answer }).await?;
        if let Some(event) = running {
            protocol::write_msg(writer, &Up::Event { event }).await?;
        }
        Ok(())
    }

    /// A release as an agent takes it, without the swap: its binaries for this target fetched by
    /// digest on the content path, then reported kept. The signature is the agent's to check;
    /// a simulated node reads the manifest as it is.
    async fn take(&mut self, release: &ReleaseOffer, counters: &Counters) -> Answer {
        let manifest =
            (release.read_unchecked()).map_err(|e| Refusal::new(RefusalClass::Release, e))?;
        let target = fleet_agent::update::TARGET;
        for binary in manifest.binaries.iter().filter(|b| b.target == target) {
            let held = self.content.blobs.has(&binary.sha256);
            self.fetch(&binary.sha256, counters).await?;
            if !held {
                counters
                    .update_bytes
                    .fetch_add(binary.size, Ordering::Relaxed);
            }
        }
        let (from, to) = (self.release.sequence, manifest.sequence);
        self.release = ReleaseFacts {
            sequence: to,
            update: Some(UpdateOutcome::Kept { from, to }),
        };
        counters.updated.fetch_add(1, Ordering::Relaxed);
        Ok(Reply::Updating { from, to })
    }

    /// The program, fetched and checked on the agent's content path unless held already.
    async fn fetch(&self, digest: &Digest, counters: &Counters) -> Answer {
        let held = self.content.blobs.has(digest);
        match self.content.fetch(digest).await {
            Ok(_) => {
                if !held {
                    counters.fetched.fetch_add(1, Ordering::Relaxed);
                }
                Ok(Reply::Staged { digest: *digest })
            }
            Err(e) => {
                counters.fetch_failures.fetch_add(1, Ordering::Relaxed);
                eprintln!("{}: {e}", self.content.node_id);
                Err(Refusal::new(RefusalClass::NotStaged, e.to_string()))
            }
        }
    }

    async fn finish<W: AsyncWrite + Unpin>(
        &mut self,
        writer: &mut W,
        run_id: RunId,
        counters: &Counters,
    ) -> Result<()> {
        self.running -= 1;
        counters.finished.fetch_add(1, Ordering::Relaxed);
        let outcome = Outcome {
            exit_code: Some(0),
            ..Outcome::default()
        };
        let event = self.record(&run_id, RunState::Finished, Some(outcome));
        protocol::write_msg(writer, &Up::Event { event }).await?;
        Ok(())
    }

    /// An event of a run, kept until acked (each session sends what is kept again first).
    fn record(&mut self, run_id: &RunId, state: RunState, outcome: Option<Outcome>) -> Event {
        self.spool.next_id += 1;
        let event = Event {
            id: self.spool.next_id,
            run_id: run_id.clone(),
            state,
            report: RunReport {
                outcome,
                ..RunReport::default()
            },
            at_unix_ms: fleet_proto::clock::now_ms(),
        };
        self.spool.unacked.push(event.clone());
        event
    }
}

/// What a simulated node remembers across its sessions, as the agent's store does: the runs it
/// started, and the events the coordinator has not acked yet.
#[derive(Default)]
struct Spool {
    next_id: u64,
    started: std::collections::HashSet<RunId>,
    unacked: Vec<Event>,
}

fn facts(capacity: Option<u32>, release: &ReleaseFacts) -> Facts {
    Facts {
        arch: std::env::consts::ARCH.to_string(),
        cpus: 2,
        memory_bytes: 24 << 30,
        disk_free_bytes: 100 << 30,
        kernel: "simulated".into(),
        os: "simulated".into(),
        agent_version: env!("CARGO_PKG_VERSION").to_string(),
        accelerators: Vec::new(),
        // None: no limit declared, as an agent from before capacities: every run is sent at once.
        max_runs: capacity,
        measured_link: None,
        release: Some(release.clone()),
        engine: None,
        content: None,
    }
}
