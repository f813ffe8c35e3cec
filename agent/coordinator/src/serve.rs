//! `coordinator serve`: one port for joins, sessions (TLS, first byte 0x16) and the bundle
//! download (plain HTTP). A refused request is answered by closing the connection, nothing more.
use super::runs::{NodeCall, SessionHandle};
use super::store::{Applied, Beat, Change, NodeEvent, RunRow};
use super::{Coordinator, http, node_id, token_hash};
use fleet_proto::fsutil::now_ms;
use fleet_proto::pin::{self, CLOCK_SKEW, CertInfo};
use fleet_proto::protocol::{self, Answer, Command, Down, MAX_UNIDENTIFIED_FRAME, StartRun, Up};
use fleet_proto::run::Workload;
use std::collections::{HashMap, HashSet};
use tokio::sync::{Notify, mpsc, oneshot};

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::server::TlsStream;

/// From accepting a connection to its first request: a peer that has not proven who it is gets
/// little time and little memory (see [`MAX_UNIDENTIFIED_FRAME`]).
const FIRST_MESSAGE_TIMEOUT: Duration = Duration::from_secs(5);
const TLS_HANDSHAKE: u8 = 0x16;
/// Heartbeats are written together this often at most (at least once per heartbeat interval):
/// one commit a second, whatever the fleet's size.
const BEAT_WRITES: Duration = Duration::from_secs(1);

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
}

/// Serves until `shutdown` resolves.
pub async fn serve(
    coordinator: Arc<Coordinator>,
    listener: TcpListener,
    config: ServeConfig,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let cert = pin::mint_cert(&coordinator.key, Duration::from_secs(10 * 365 * 86400))
        .map_err(std::io::Error::other)?;
    let tls = tokio_rustls::TlsAcceptor::from(
        pin::server_config(&coordinator.key, cert).map_err(std::io::Error::other)?,
    );
    let config = Arc::new(config);
    coordinator
        .live
        .serving
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let _ = coordinator.live.address.set(config.advertise.clone());
    let joined = coordinator.clone();
    let lease = config.lease;
    tokio::task::spawn_blocking(move || join_fleet(&joined, lease))
        .await
        .map_err(std::io::Error::other)?
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    let sweeper = tokio::spawn(sweep_forever(coordinator.clone(), config.clone()));
    let _stop_sweeper = AbortOnDrop(sweeper);
    let beats = tokio::spawn(write_beats_forever(
        coordinator.clone(),
        BEAT_WRITES.min(config.heartbeat),
    ));
    let _stop_beats = AbortOnDrop(beats);
    let poll = tokio::spawn(wake_waiting_forever(coordinator.clone(), config.heartbeat));
    let _stop_poll = AbortOnDrop(poll);
    let listening = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let _stop_listening = ClearOnDrop(listening.clone());
    listen_for_waiting(coordinator.clone(), listening);
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            _ = &mut shutdown => return Ok(()),
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let (coordinator, config, tls) = (coordinator.clone(), config.clone(), tls.clone());
        tokio::spawn(async move {
            let _ = stream.set_nodelay(true);
            let mut first = [0u8; 1];
            match tokio::time::timeout(FIRST_MESSAGE_TIMEOUT, stream.peek(&mut first)).await {
                Ok(Ok(1)) if first[0] == TLS_HANDSHAKE => {
                    if let Err(reason) = handle_tls(&coordinator, &config, tls, stream).await {
                        tracing::info!(%peer, "closed a connection without answering: {reason}");
                    }
                }
                Ok(Ok(1)) => http::handle(&coordinator, &config.bundles, stream).await,
                _ => {}
            }
        });
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

struct ClearOnDrop(Arc<std::sync::atomic::AtomicBool>);

impl Drop for ClearOnDrop {
    fn drop(&mut self) {
        self.0.store(false, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Writes the heartbeats gathered since the last write, in one change (one commit).
async fn write_beats_forever(coordinator: Arc<Coordinator>, period: Duration) {
    let mut tick = tokio::time::interval(period);
    loop {
        tick.tick().await;
        let beats: Vec<Beat> = std::mem::take(&mut *coordinator.live.beats.lock().expect("beats"))
            .into_values()
            .collect();
        if beats.is_empty() {
            continue;
        }
        // Apart from the group commit's queue: a backlog of runs' changes never delays a lease.
        let kept = beats.clone();
        let written = coordinator
            .with_store(move |store| store.write_leases(&beats))
            .await;
        if let Err(e) = written {
            tracing::warn!("writing heartbeats failed (tried again with the next ones): {e}");
            let mut waiting = coordinator.live.beats.lock().expect("beats");
            for beat in kept {
                waiting.entry(beat.node_id.clone()).or_insert(beat);
            }
        }
    }
}

/// Wakes the sessions held here whose node has runs waiting: one read of the waiting index,
/// whatever the fleet's size.
fn wake_waiting_sessions(coordinator: &Coordinator) {
    match coordinator.store.waiting_nodes() {
        Ok(nodes) => coordinator.live.wake(nodes.iter().map(String::as_str)),
        Err(e) => tracing::warn!("reading the waiting runs failed: {e}"),
    }
}

/// Runs created through another coordinator of the same database wake the sessions held here
/// at once: that coordinator's commit notifies (PostgreSQL's NOTIFY), this thread hears it.
/// A store only this coordinator opens has nobody to hear from, and the thread ends at once.
fn listen_for_waiting(coordinator: Arc<Coordinator>, serving: Arc<std::sync::atomic::AtomicBool>) {
    let listen = move || {
        while serving.load(std::sync::atomic::Ordering::SeqCst) {
            match coordinator.store.wait_for_waiting(Duration::from_secs(1)) {
                None => return,
                Some(Ok(true)) => wake_waiting_sessions(&coordinator),
                Some(Ok(false)) => {}
                Some(Err(e)) => {
                    tracing::warn!("listening for runs from the other coordinators failed: {e}");
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
        }
    };
    let spawned = std::thread::Builder::new()
        .name("listen-waiting".into())
        .spawn(listen);
    if let Err(e) = spawned {
        tracing::warn!("cannot listen for runs from the other coordinators: {e}");
    }
}

/// The fallback for a wake-up that did not come (a notice lost while the database restarted):
/// every `period`, the sessions held here whose node has runs waiting look at them.
async fn wake_waiting_forever(coordinator: Arc<Coordinator>, period: Duration) {
    let mut tick = tokio::time::interval(period);
    loop {
        tick.tick().await;
        let waker = coordinator.clone();
        if let Err(e) = tokio::task::spawn_blocking(move || wake_waiting_sessions(&waker)).await {
            tracing::warn!("waking the sessions with runs waiting did not complete: {e}");
        }
    }
}

/// Says in the store that this coordinator serves it, and learns which others do (those heard
/// within a lease).
fn join_fleet(coordinator: &Coordinator, lease: Duration) -> Result<(), crate::CoordinatorError> {
    let now = now_ms();
    if let Some(address) = coordinator.live.address.get() {
        coordinator.store.heard_coordinator(address, now)?;
    }
    let since = now.saturating_sub(lease.as_millis() as u64);
    *coordinator.live.fleet.lock().expect("fleet") = coordinator.store.coordinators_since(since)?;
    Ok(())
}

/// Every heartbeat: fail runs nobody took in time, mark runs of silent nodes `lost`.
async fn sweep_forever(coordinator: Arc<Coordinator>, config: Arc<ServeConfig>) {
    let up_since = now_ms();
    let mut tick = tokio::time::interval(config.heartbeat);
    loop {
        tick.tick().await;
        let (swept_by, config) = (coordinator.clone(), config.clone());
        // The sweep is store calls only: off the async thread, like every other store call here.
        let swept = tokio::task::spawn_blocking(move || {
            if let Err(e) = join_fleet(&swept_by, config.lease) {
                tracing::warn!("saying this coordinator serves the store failed: {e}");
            }
            if let Err(e) = swept_by.sweep_blobs(crate::content::BLOB_GRACE) {
                tracing::warn!("the blob sweep failed: {e}");
            }
            // One coordinator of a fleet sweeps the runs (the first by address of those heard
            // within a lease); when it goes away, the next one takes over.
            if !swept_by.live.sweeps() {
                return Ok(());
            }
            swept_by.sweep(
                config.waiting_timeout.as_millis() as u64,
                up_since,
                config.lease.as_millis() as u64,
            )
        })
        .await;
        match swept {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!("the run sweep failed: {e}"),
            Err(e) => tracing::warn!("the run sweep did not complete: {e}"),
        }
    }
}

/// Err carries why the connection was dropped, for the coordinator's own log only.
async fn handle_tls(
    coordinator: &Coordinator,
    config: &ServeConfig,
    tls: tokio_rustls::TlsAcceptor,
    stream: TcpStream,
) -> Result<(), String> {
    let mut stream = tokio::time::timeout(FIRST_MESSAGE_TIMEOUT, tls.accept(stream))
        .await
        .map_err(|_| "the handshake timed out".to_string())?
        .map_err(|e| format!("the handshake failed: {e}"))?;
    let cert = peer_cert(&stream).ok_or("no client certificate")?;
    // Another coordinator of the fleet proves the fleet's own key.
    let peer = cert.key == coordinator.key.public_key_raw();
    let first = tokio::time::timeout(
        FIRST_MESSAGE_TIMEOUT,
        protocol::read_msg_within::<_, Up>(&mut stream, MAX_UNIDENTIFIED_FRAME),
    )
    .await
    .map_err(|_| "no request within the timeout".to_string())?
    .map_err(|e| e.to_string())?
    .ok_or("closed before a request")?;
    match first {
        Up::Join { token, .. } => {
            let key = pin::key_text(&cert.key);
            let id = node_id(&cert.key);
            let now = now_ms();
            let lease_until = now + config.lease.as_millis() as u64;
            let (hash, key_for_store) = (token_hash(&token.0), key.clone());
            let redeemed = coordinator
                .with_store(move |store| store.redeem(&hash, &key_for_store, &id, now, lease_until))
                .await
                .map_err(|e| e.to_string())?
                .ok_or("a join with an unknown, expired or already spent token")?;
            let node = redeemed.node;
            if redeemed.first {
                tracing::info!(node_id = %node.id, name = ?node.name, public_key = %key, "node joined");
            } else {
                tracing::info!(node_id = %node.id, "answered a join again for the same key (its answer was lost)");
            }
            protocol::write_msg(&mut stream, &Down::Joined { node_id: node.id })
                .await
                .map_err(|e| e.to_string())
        }
        Up::Hello { node_id } => session(coordinator, config, stream, cert, node_id).await,
        Up::Relay { node_id, command } if peer => {
            let answer = coordinator.relayed(&node_id, command).await;
            protocol::write_msg(&mut stream, &Down::Relayed { answer })
                .await
                .map_err(|e| e.to_string())
        }
        Up::Fetch {
            node_id, digest, ..
        } if peer => {
            coordinator
                .send_content(&mut stream, &node_id, &digest, 0)
                .await
        }
        Up::Fetch {
            node_id,
            digest,
            offset,
            ticket,
        } => {
            known_node(coordinator, &cert, &node_id).await?;
            // Content imported through another coordinator of the fleet is copied here first.
            if let Err(e) = coordinator.ensure_blob(&digest).await {
                tracing::warn!(%node_id, %digest, "content not found in the fleet: {e}");
            }
            if let Some(ticket) = ticket
                && let Err(message) = coordinator.spend_ticket(&ticket, &node_id, &digest)
            {
                let refused = Down::ContentRefused {
                    message: message.clone(),
                };
                let _ = protocol::write_msg(&mut stream, &refused).await;
                return Err(message);
            }
            coordinator
                .send_content(&mut stream, &node_id, &digest, offset)
                .await
        }
        Up::Upload {
            node_id,
            upload,
            size,
        } => {
            known_node(coordinator, &cert, &node_id).await?;
            let lock = match coordinator.upload_expected(&upload, &node_id) {
                Ok(lock) => lock,
                Err(message) => {
                    let refused = Down::ContentRefused {
                        message: message.clone(),
                    };
                    let _ = protocol::write_msg(&mut stream, &refused).await;
                    return Err(message);
                }
            };
            let _one_try_at_a_time = lock.lock().await;
            coordinator
                .receive_content(&mut stream, &node_id, &upload, size)
                .await
        }
        _ => Err("a first message that is neither join, hello, fetch nor upload".into()),
    }
}

fn peer_cert(stream: &TlsStream<TcpStream>) -> Option<CertInfo> {
    let certs = stream.get_ref().1.peer_certificates()?;
    pin::cert_info(certs.first()?).ok()
}

/// A session or content connection is a known node's only when its certificate carries the
/// key that node joined with.
async fn known_node(
    coordinator: &Coordinator,
    cert: &CertInfo,
    node_id: &str,
) -> Result<(), String> {
    let id = node_id.to_string();
    let node = coordinator
        .with_store(move |store| store.node(&id))
        .await
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("a connection for an unknown node {node_id}"))?;
    if node.public_key != pin::key_text(&cert.key) {
        return Err(format!("a connection for {node_id} from another key"));
    }
    Ok(())
}

async fn session(
    coordinator: &Coordinator,
    config: &ServeConfig,
    mut stream: TlsStream<TcpStream>,
    cert: CertInfo,
    node_id: String,
) -> Result<(), String> {
    known_node(coordinator, &cert, &node_id).await?;
    // The certificate is dated by the node's clock, which may be hours off: only its length
    // counts, and the session lapses that long from now by this coordinator's clock.
    let longest = (config.max_session_validity + CLOCK_SKEW).as_secs() as i64;
    let length = cert.not_after - cert.not_before;
    if length <= 0 {
        return Err(format!("{node_id} presented an empty session certificate"));
    }
    if length > longest {
        return Err(format!(
            "{node_id} presented a session certificate valid for longer than the allowed {} s",
            config.max_session_validity.as_secs()
        ));
    }
    let lease_ms = config.lease.as_millis() as u64;
    let opened = coordinator
        .commits
        .submit(Change::OpenSession {
            node_id: node_id.clone(),
            lease_until_ms: now_ms() + lease_ms,
            at: coordinator.live.address.get().cloned(),
        })
        .await
        .map_err(|e| e.to_string())?;
    let Applied::Generation(generation) = opened else {
        return Err(format!("opening a session was answered with {opened:?}"));
    };
    let welcome = Down::Welcome {
        generation,
        heartbeat_ms: config.heartbeat.as_millis() as u64,
        lease_ms,
        coordinators: coordinator.live.fleet.lock().expect("fleet").clone(),
    };
    protocol::write_msg(&mut stream, &welcome)
        .await
        .map_err(|e| e.to_string())?;
    tracing::info!(%node_id, generation, at = ?coordinator.live.address.get(), "session open");
    let lapses = tokio::time::Instant::now() + Duration::from_secs(length as u64);
    let (calls_tx, calls) = mpsc::channel(16);
    let wake = Arc::new(Notify::new());
    let handle = SessionHandle {
        generation,
        calls: calls_tx,
        wake: wake.clone(),
    };
    (coordinator.live.sessions.lock().expect("sessions")).insert(node_id.clone(), handle);
    let (reader, writer) = tokio::io::split(stream);
    let mut link = Link {
        coordinator,
        node_id: node_id.clone(),
        generation,
        writer,
        lease_ms,
        staged: HashSet::new(),
        inflight: HashMap::new(),
        next_op: 0,
    };
    let ended = link.serve(reader, calls, &wake, lapses, config.lease).await;
    let mut sessions = coordinator.live.sessions.lock().expect("sessions");
    // A newer session of the same node may have registered meanwhile; leave it be.
    if sessions
        .get(&node_id)
        .is_some_and(|s| s.generation == generation)
    {
        sessions.remove(&node_id);
    }
    ended
}

/// What an answered operation was for.
enum Pending {
    Stage,
    Start { run_id: String },
    Call(oneshot::Sender<Answer>),
}

/// One node's live session on the coordinator side.
struct Link<'a, W> {
    coordinator: &'a Coordinator,
    node_id: String,
    generation: u64,
    writer: W,
    lease_ms: u64,
    /// Programs sent to the node in this session.
    staged: HashSet<String>,
    inflight: HashMap<String, Pending>,
    next_op: u64,
}

const BATCH: usize = 256;

impl<W: tokio::io::AsyncWrite + Unpin> Link<'_, W> {
    async fn serve<R: tokio::io::AsyncRead + Unpin + Send + 'static>(
        &mut self,
        reader: R,
        mut calls: mpsc::Receiver<NodeCall>,
        wake: &Notify,
        lapses: tokio::time::Instant,
        lease: Duration,
    ) -> Result<(), String> {
        let node_id = self.node_id.clone();
        // A reader task of its own: a read cancelled halfway through a frame would lose it. The
        // messages are boxed: a channel allocates its slots in blocks, and an idle session should
        // hold a block of pointers, not of whole messages.
        let (tx, mut inbox) = mpsc::channel::<Box<Read>>(BATCH);
        // A heartbeat is noted as it is read: a session waiting on a slow store stays alive.
        let (beats, lease_ms) = (self.coordinator.live.beats.clone(), self.lease_ms);
        let reading = tokio::spawn(async move {
            let mut reader = reader;
            loop {
                let msg = protocol::read_msg::<_, serde_json::Value>(&mut reader)
                    .await
                    .map(|m| m.map(parse_up));
                if let Ok(Some(Inbound::Message(Up::Heartbeat))) = &msg {
                    let beat = beat_now(&node_id, lease_ms);
                    beats.lock().expect("beats").insert(node_id.clone(), beat);
                }
                let end = !matches!(msg, Ok(Some(_)));
                if tx.send(Box::new(msg)).await.is_err() || end {
                    return;
                }
            }
        });
        let node_id = self.node_id.clone();
        let result = async {
            self.dispatch().await?;
            loop {
                tokio::select! {
                    _ = tokio::time::sleep_until(lapses) => {
                        return Err(format!("the session credential of {node_id} lapsed"));
                    }
                    _ = wake.notified() => self.dispatch().await?,
                    Some(call) = calls.recv() => {
                        let (command, reply) = *call;
                        let op = self.op_id("call");
                        self.inflight.insert(op.clone(), Pending::Call(reply));
                        self.send(op, command).await?;
                    }
                    msg = tokio::time::timeout(lease, inbox.recv()) => {
                        let first = match msg.map(|m| m.map(|boxed| *boxed)) {
                            Err(_) => return Err(format!("{node_id} was silent for a whole lease")),
                            Ok(None) => return Err(format!("the session of {node_id} ended")),
                            Ok(Some(Err(e))) => return Err(format!("the session of {node_id} failed: {e}")),
                            Ok(Some(Ok(None))) => {
                                tracing::info!(%node_id, generation = self.generation, "session closed by the agent");
                                return Ok(());
                            }
                            Ok(Some(Ok(Some(msg)))) => msg,
                        };
                        // Take what else is already here, so events are stored in one transaction.
                        let mut batch = vec![first];
                        while batch.len() < BATCH {
                            match inbox.try_recv().map(|boxed| *boxed) {
                                Ok(Ok(Some(msg))) => batch.push(msg),
                                _ => break,
                            }
                        }
                        self.handle(batch).await?;
                    }
                }
            }
        }
        .await;
        reading.abort();
        result
    }

    fn op_id(&mut self, kind: &str) -> String {
        self.next_op += 1;
        format!("{kind}-g{}-{}", self.generation, self.next_op)
    }

    async fn send(&mut self, op: String, command: Command) -> Result<(), String> {
        let msg = Down::Command {
            op,
            generation: self.generation,
            command,
        };
        protocol::write_msg(&mut self.writer, &msg)
            .await
            .map_err(|e| e.to_string())
    }

    /// Sends every run waiting for this node that is not in flight yet, staging its program first.
    async fn dispatch(&mut self) -> Result<(), String> {
        let node_id = self.node_id.clone();
        let read = (self.coordinator)
            .with_store(move |store| store.waiting_runs(&node_id))
            .await;
        // A store that cannot be read now costs no session: the next wake-up or poll looks again.
        let waiting: Vec<RunRow> = match read {
            Ok(waiting) => waiting,
            Err(e) => {
                tracing::warn!(node_id = %self.node_id, "cannot read the runs waiting: {e}");
                return Ok(());
            }
        };
        for run in waiting {
            // Stable op ids: a start redelivered in a later session is answered from the node's record.
            let op = format!("start-{}", run.id);
            if self.inflight.contains_key(&op) {
                continue;
            }
            if let Workload::Program(program) = &run.workload
                && self.staged.insert(program.to_string())
            {
                let stage = Command::Stage {
                    digest: program.clone(),
                };
                let stage_op = format!("stage-{}", program.hex());
                self.inflight.insert(stage_op.clone(), Pending::Stage);
                self.send(stage_op, stage).await?;
            }
            let registry_auth = if run.needs_registry_auth {
                let held = (self.coordinator.live.credentials.lock())
                    .expect("credentials")
                    .get(&run.id)
                    .cloned();
                if held.is_none() {
                    self.fail_without_credential(&run.id).await?;
                    continue;
                }
                held
            } else {
                None
            };
            self.inflight.insert(
                op.clone(),
                Pending::Start {
                    run_id: run.id.clone(),
                },
            );
            if let Some(raw) = run.raw_command {
                tracing::info!(node_id = %self.node_id, run_id = %run.id, "sending a raw command in place of the start");
                self.send_raw(op, raw).await?;
                continue;
            }
            let start = Command::Start(StartRun {
                run_id: run.id,
                workload: run.workload,
                registry_auth,
                options: run.options,
            });
            self.send(op, start).await?;
        }
        Ok(())
    }

    /// Sends `raw` as the command object of a command message, unchecked: what a coordinator of
    /// another protocol version could send (for protocol-skew testing).
    async fn send_raw(&mut self, op: String, raw: serde_json::Value) -> Result<(), String> {
        // The envelope comes from the protocol's own type; only its command object is replaced.
        let envelope = Down::Command {
            op,
            generation: self.generation,
            command: Command::Facts,
        };
        let mut msg = serde_json::to_value(envelope).expect("protocol messages serialize");
        msg["command"] = raw;
        protocol::write_msg(&mut self.writer, &msg)
            .await
            .map_err(|e| e.to_string())
    }

    async fn handle(&mut self, batch: Vec<Inbound>) -> Result<(), String> {
        let mut events = Vec::new();
        let mut accepted = Vec::new();
        for msg in batch {
            let msg = match msg {
                Inbound::Message(msg) => msg,
                Inbound::UnreadableEvent(event) => {
                    if let NodeEvent::Unreadable {
                        id, run_id, reason, ..
                    } = &event
                    {
                        tracing::warn!(node_id = %self.node_id, event = id, %run_id, "refused an event: {reason}");
                    }
                    events.push(event);
                    continue;
                }
                Inbound::Malformed(reason) => {
                    return Err(format!(
                        "{} sent a malformed message: {reason}",
                        self.node_id
                    ));
                }
            };
            match msg {
                Up::Event { event } => events.push(NodeEvent::Known(event)),
                // Noted by the reader already; here it only proves the session alive.
                Up::Heartbeat => {}
                Up::Facts { facts } => self.heartbeat(facts).await?,
                Up::Result { op, answer } => self.answered(&op, answer, &mut accepted),
                _ => {
                    return Err(format!(
                        "{} sent a message that does not belong in a session",
                        self.node_id
                    ));
                }
            }
        }
        if !accepted.is_empty() {
            self.commit(Change::Accept(accepted)).await?;
        }
        if !events.is_empty() {
            let change = Change::Events {
                node_id: self.node_id.clone(),
                events,
            };
            let Applied::EventsUpTo(up_to) = self.commit(change).await? else {
                return Err("storing events was answered with something else".into());
            };
            protocol::write_msg(&mut self.writer, &Down::Ack { up_to })
                .await
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// A heartbeat heard now, and the lease it extends.
    fn beat(&self) -> Beat {
        beat_now(&self.node_id, self.lease_ms)
    }

    /// Records new facts, with the heartbeat they are.
    async fn heartbeat(&self, facts: fleet_proto::facts::Facts) -> Result<(), String> {
        let beat = self.beat();
        self.commit(Change::Facts { beat, facts }).await.map(drop)
    }

    async fn commit(&self, change: Change) -> Result<Applied, String> {
        (self.coordinator.commits.submit(change).await).map_err(|e| e.to_string())
    }

    /// A run whose registry credential is gone (the coordinator restarted before the node took
    /// it): failed with the reason, since the credential was never stored.
    async fn fail_without_credential(&mut self, run_id: &str) -> Result<(), String> {
        let id = run_id.to_string();
        self.coordinator
            .with_store(move |store| {
                store.fail_run(
                    &id,
                    fleet_proto::run::RunState::Failed,
                    "the registry credential was kept only in the coordinator's memory and is gone (it restarted before the node took the run); run it again with --registry-auth",
                )
            })
            .await
            .map(drop)
            .map_err(|e| e.to_string())
    }

    /// Settles an answered operation; start answers are gathered for one transaction.
    fn answered(&mut self, op: &str, answer: Answer, accepted: &mut Vec<(String, Option<String>)>) {
        let error = answer.as_ref().err().map(|r| r.message.clone());
        match self.inflight.remove(op) {
            Some(Pending::Start { run_id }) => {
                // The node has the run now: its credential is no longer needed anywhere here.
                self.coordinator
                    .live
                    .credentials
                    .lock()
                    .expect("credentials")
                    .remove(&run_id);
                accepted.push((run_id, error));
            }
            Some(Pending::Stage) => {
                if let Some(e) = error {
                    tracing::warn!(node_id = %self.node_id, "staging failed: {e}");
                }
            }
            Some(Pending::Call(reply)) => {
                let _ = reply.send(answer);
            }
            None => tracing::debug!(op, "an answer to an operation not in flight"),
        }
    }
}

/// A heartbeat heard now, and the lease it extends. Heartbeats are noted by the session's reader
/// and written for the whole fleet together (see [`write_beats_forever`]).
fn beat_now(node_id: &str, lease_ms: u64) -> Beat {
    let now = now_ms();
    Beat {
        node_id: node_id.to_string(),
        at_ms: now,
        lease_until_ms: now + lease_ms,
    }
}

/// What the reader task hands the session: a message, the end, or why reading failed.
type Read = Result<Option<Inbound>, protocol::FrameError>;

/// A message from a node, read leniently enough that one event this coordinator cannot read (a
/// state from a newer agent) is refused on its own while the session goes on.
enum Inbound {
    Message(Up),
    UnreadableEvent(NodeEvent),
    Malformed(String),
}

fn parse_up(value: serde_json::Value) -> Inbound {
    let is_event = value.get("type").and_then(|t| t.as_str()) == Some("event");
    let event = value.get("event").cloned();
    match serde_json::from_value::<Up>(value) {
        Ok(msg) => Inbound::Message(msg),
        Err(e) => match event
            .filter(|_| is_event)
            .and_then(|ev| unreadable_event(ev, &e))
        {
            Some(event) => Inbound::UnreadableEvent(event),
            None => Inbound::Malformed(e.to_string()),
        },
    }
}

/// An event whose envelope is intact (id, run) but whose content does not parse.
fn unreadable_event(event: serde_json::Value, error: &serde_json::Error) -> Option<NodeEvent> {
    let id = event.get("id")?.as_u64()?;
    let run_id = event.get("run_id")?.as_str()?.to_string();
    let at_ms = event
        .get("at_unix_ms")
        .and_then(|t| t.as_u64())
        .unwrap_or(0);
    let state = event
        .get("state")
        .map(|s| s.to_string())
        .unwrap_or_default();
    Some(NodeEvent::Unreadable {
        id,
        run_id,
        at_ms,
        reason: format!(
            "event {id} carries state {state}, which this coordinator cannot read ({error}); upgrade the coordinator to the agent's version"
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_with_an_unknown_state_is_refused_alone() {
        let wire = serde_json::json!({
            "type": "event",
            "event": { "id": 7, "run_id": "r-1", "state": "paused", "at_unix_ms": 5 }
        });
        let Inbound::UnreadableEvent(NodeEvent::Unreadable {
            id, run_id, reason, ..
        }) = parse_up(wire)
        else {
            panic!("an unknown state must be an unreadable event");
        };
        assert_eq!((id, run_id.as_str()), (7, "r-1"));
        assert!(reason.starts_with("event 7 carries state \"paused\", which this coordinator cannot read (unknown variant `paused`"), "{reason}");
        let known = serde_json::json!({
            "type": "event",
            "event": { "id": 8, "run_id": "r-1", "state": "running", "at_unix_ms": 5 }
        });
        assert!(matches!(
            parse_up(known),
            Inbound::Message(Up::Event { .. })
        ));
        assert!(matches!(
            parse_up(serde_json::json!({ "type": "launch" })),
            Inbound::Malformed(_)
        ));
    }
}
