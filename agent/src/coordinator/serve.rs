//! `coordinator serve`: one port for joins, sessions (TLS, first byte 0x16) and the bundle
//! download (plain HTTP). A refused request is answered by closing the connection, nothing more.
use super::runs::NodeCall;
use super::store::RunRow;
use super::{Coordinator, http, node_id, token_hash};
use crate::fsutil::now_ms;
use crate::pin::{self, CLOCK_SKEW, CertInfo};
use crate::protocol::{self, Command, Down, StartRun, Up};
use base64::Engine;
use std::collections::{HashMap, HashSet};
use tokio::sync::{mpsc, oneshot};

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::server::TlsStream;

const FIRST_MESSAGE_TIMEOUT: Duration = Duration::from_secs(10);
const TLS_HANDSHAKE: u8 = 0x16;

#[derive(Debug, Clone)]
pub struct ServeConfig {
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
    let sweeper = tokio::spawn(sweep_forever(coordinator.clone(), config.clone()));
    let _stop_sweeper = AbortOnDrop(sweeper);
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

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
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
    let first = tokio::time::timeout(
        FIRST_MESSAGE_TIMEOUT,
        protocol::read_msg::<_, Up>(&mut stream),
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
        _ => Err("a first message that is neither join nor hello".into()),
    }
}

fn peer_cert(stream: &TlsStream<TcpStream>) -> Option<CertInfo> {
    let certs = stream.get_ref().1.peer_certificates()?;
    pin::cert_info(certs.first()?).ok()
}

async fn session(
    coordinator: &Coordinator,
    config: &ServeConfig,
    mut stream: TlsStream<TcpStream>,
    cert: CertInfo,
    node_id: String,
) -> Result<(), String> {
    let id = node_id.clone();
    let node = coordinator
        .with_store(move |store| store.node(&id))
        .await
        .map_err(|e| e.to_string())?
        .ok_or("a session for an unknown node")?;
    if node.public_key != pin::key_text(&cert.key) {
        return Err(format!("a session for {node_id} from another key"));
    }
    let now_s = (now_ms() / 1000) as i64;
    let longest = (config.max_session_validity + CLOCK_SKEW).as_secs() as i64;
    if cert.not_after <= now_s {
        return Err(format!("{node_id} presented a lapsed session certificate"));
    }
    if cert.not_after - cert.not_before > longest {
        return Err(format!(
            "{node_id} presented a session certificate valid for longer than the allowed {} s",
            config.max_session_validity.as_secs()
        ));
    }
    let lease_ms = config.lease.as_millis() as u64;
    let id = node_id.clone();
    let generation = coordinator
        .with_store(move |store| store.open_session(&id, now_ms() + lease_ms))
        .await
        .map_err(|e| e.to_string())?;
    let welcome = Down::Welcome {
        generation,
        heartbeat_ms: config.heartbeat.as_millis() as u64,
        lease_ms,
    };
    protocol::write_msg(&mut stream, &welcome)
        .await
        .map_err(|e| e.to_string())?;
    tracing::info!(%node_id, generation, "session open");
    let lapses = tokio::time::Instant::now() + Duration::from_secs((cert.not_after - now_s) as u64);
    let (calls_tx, calls) = mpsc::channel(16);
    coordinator
        .live
        .sessions
        .lock()
        .expect("sessions")
        .insert(node_id.clone(), (generation, calls_tx));
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
    let ended = link.serve(reader, calls, lapses, config.lease).await;
    let mut sessions = coordinator.live.sessions.lock().expect("sessions");
    // A newer session of the same node may have registered meanwhile; leave it be.
    if sessions
        .get(&node_id)
        .is_some_and(|(g, _)| *g == generation)
    {
        sessions.remove(&node_id);
    }
    ended
}

/// What an answered operation was for.
enum Pending {
    Stage,
    Start { run_id: String },
    Call(oneshot::Sender<serde_json::Value>),
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
        lapses: tokio::time::Instant,
        lease: Duration,
    ) -> Result<(), String> {
        let node_id = self.node_id.clone();
        // A reader task of its own: a read cancelled halfway through a frame would lose it.
        let (tx, mut inbox) = mpsc::channel::<Result<Option<Up>, protocol::FrameError>>(BATCH);
        let reading = tokio::spawn(async move {
            let mut reader = reader;
            loop {
                let msg = protocol::read_msg::<_, Up>(&mut reader).await;
                let end = !matches!(msg, Ok(Some(_)));
                if tx.send(msg).await.is_err() || end {
                    return;
                }
            }
        });
        let mut changes = self.coordinator.live.changes.subscribe();
        let result = async {
            self.dispatch().await?;
            loop {
                tokio::select! {
                    _ = tokio::time::sleep_until(lapses) => {
                        return Err(format!("the session credential of {node_id} lapsed"));
                    }
                    changed = changes.changed() => {
                        if changed.is_ok() {
                            self.dispatch().await?;
                        }
                    }
                    Some((command, reply)) = calls.recv() => {
                        let op = self.op_id("call");
                        self.inflight.insert(op.clone(), Pending::Call(reply));
                        self.send(op, command).await?;
                    }
                    msg = tokio::time::timeout(lease, inbox.recv()) => {
                        let first = match msg {
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
                            match inbox.try_recv() {
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
        let mut waiting: Vec<RunRow> = self
            .coordinator
            .with_store(|store| store.active_runs())
            .await
            .map_err(|e| e.to_string())?
            .into_iter()
            .filter(|r| r.node_id == self.node_id && !r.accepted)
            .collect();
        waiting.sort_by_key(|r| r.created_ms);
        for run in waiting {
            // Stable op ids: a start redelivered in a later session is answered from the node's record.
            let op = format!("start-{}", run.id);
            if self.inflight.contains_key(&op) {
                continue;
            }
            if self.staged.insert(run.program.clone()) {
                let digest = run.program.clone();
                let bytes = self
                    .coordinator
                    .with_store(move |store| store.program(&digest))
                    .await
                    .map_err(|e| e.to_string())?
                    .unwrap_or_default();
                let stage = Command::Stage {
                    digest: run.program.clone(),
                    program_b64: B64.encode(bytes),
                };
                let stage_op = format!("stage-{}", run.program.trim_start_matches("sha256:"));
                self.inflight.insert(stage_op.clone(), Pending::Stage);
                self.send(stage_op, stage).await?;
            }
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
                program: run.program,
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

    async fn handle(&mut self, batch: Vec<Up>) -> Result<(), String> {
        let mut events = Vec::new();
        let mut accepted = Vec::new();
        let mut heartbeat = false;
        for msg in batch {
            match msg {
                Up::Event { event } => events.push(event),
                Up::Heartbeat => heartbeat = true,
                Up::Facts { facts } => self.heartbeat(Some(facts)).await?,
                Up::Result { op, result } => self.answered(&op, result, &mut accepted),
                _ => {
                    return Err(format!(
                        "{} sent a message that does not belong in a session",
                        self.node_id
                    ));
                }
            }
        }
        // Events prove the node alive too, but the lease is only written on heartbeats: one write
        // per interval, not one per batch.
        if heartbeat {
            self.heartbeat(None).await?;
        }
        if !accepted.is_empty() {
            self.coordinator
                .with_store(move |store| store.accept_runs(&accepted))
                .await
                .map_err(|e| e.to_string())?;
        }
        if !events.is_empty() {
            let id = self.node_id.clone();
            let up_to = self
                .coordinator
                .with_store(move |store| store.apply_events(&id, &events))
                .await
                .map_err(|e| e.to_string())?;
            protocol::write_msg(&mut self.writer, &Down::Ack { up_to })
                .await
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// Records a heartbeat (with new facts, when given) and extends the node's lease.
    async fn heartbeat(&self, facts: Option<crate::facts::Facts>) -> Result<(), String> {
        let (id, lease_ms) = (self.node_id.clone(), self.lease_ms);
        self.coordinator
            .with_store(move |store| {
                let now = now_ms();
                store.heartbeat(&id, now, now + lease_ms, facts)
            })
            .await
            .map_err(|e| e.to_string())
    }

    /// Settles an answered operation; start answers are gathered for one transaction.
    fn answered(
        &mut self,
        op: &str,
        result: serde_json::Value,
        accepted: &mut Vec<(String, Option<String>)>,
    ) {
        let error = result
            .get("error")
            .and_then(|e| e.as_str())
            .map(str::to_string);
        match self.inflight.remove(op) {
            Some(Pending::Start { run_id }) => accepted.push((run_id, error)),
            Some(Pending::Stage) => {
                if let Some(e) = error {
                    tracing::warn!(node_id = %self.node_id, "staging failed: {e}");
                }
            }
            Some(Pending::Call(reply)) => {
                let _ = reply.send(result);
            }
            None => tracing::debug!(op, "an answer to an operation not in flight"),
        }
    }
}
