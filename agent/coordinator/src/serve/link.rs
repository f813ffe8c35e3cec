//! A node's live session on the coordinator's side: the welcome, then a [`Link`] that, when
//! woken, reads only its own node's waiting runs and sends them, hands start answers and event
//! batches to the group commit and acks them, and reads events leniently so that one it cannot
//! read is refused alone. It ends when the node goes, its credential lapses, or the coordinator
//! stops ([`Stopping`]).
use super::ServeConfig;
use super::identify::{ended, known_node};
use crate::Coordinator;
use crate::error::Dropped;
use crate::live::{FetchSlot, NodeCall, SessionHandle, Wake, beat_now};
use crate::store::{Applied, Beat, Change, NodeEvent, StoreError};
use fleet_proto::clock::now_ms;
use fleet_proto::pin::{CLOCK_SKEW, CertInfo};
use fleet_proto::protocol::{self, Answer, Command, Down, NodeEnd, StartRun, Up};
use fleet_proto::run::Workload;
use fleet_proto::version::{ProtocolVersion, Versions};
use fleet_proto::{NodeId, OpId, RunId};
use std::collections::{HashMap, HashSet};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot, watch};
use tokio_rustls::server::TlsStream;

/// Turns true when the coordinator stops serving: every session then ends, and its node
/// reconnects (to another coordinator of the fleet, or to this one once it is back).
pub(super) type Stopping = watch::Receiver<bool>;

/// How long a session busy with the store when the coordinator stops gets to finish by itself.
const STOP_PREEMPTS_AFTER: Duration = Duration::from_secs(1);

/// Resolves once the coordinator stops serving (or is gone).
async fn stopped(stopping: &mut Stopping) {
    // The value's guard is dropped here: it must not live in a session's future.
    let _ = stopping.wait_for(|stop| *stop).await.map(drop);
}

/// Tells a node saying hello that this coordinator cannot serve it now, and why; answers the
/// reason the connection is dropped.
async fn unavailable(stream: &mut TlsStream<TcpStream>, e: StoreError) -> Dropped {
    let message = e.to_string();
    let _ = protocol::write_msg(stream, &Down::Unavailable { message }).await;
    Dropped::Store(e)
}

/// Resolves with the node's end once the operator ends it; never, once a newer session of the
/// node took its place (the handle that would say so is gone).
async fn ended_by_operator(ending: &mut watch::Receiver<Option<NodeEnd>>) -> NodeEnd {
    let end = ending.wait_for(Option::is_some).await.map(|end| *end);
    match end {
        Ok(Some(end)) => end,
        _ => std::future::pending().await,
    }
}

pub(super) async fn session(
    coordinator: &Coordinator,
    config: &ServeConfig,
    mut stream: TlsStream<TcpStream>,
    cert: CertInfo,
    node_id: NodeId,
    protocol: ProtocolVersion,
    stopping: Stopping,
) -> Result<(), Dropped> {
    let node = match known_node(coordinator, &cert, &node_id).await {
        Err(Dropped::Store(e)) => return Err(unavailable(&mut stream, e).await),
        node => node?,
    };
    if let Some(ending) = node.ended {
        let told = Down::Ended { end: ending.end };
        protocol::write_msg(&mut stream, &told).await?;
        return Err(ended(&node_id, ending.end));
    }
    // The certificate is dated by the node's clock, which may be hours off: only its length
    // counts, and the session lapses that long from now by this coordinator's clock.
    let longest = (config.max_session_validity + CLOCK_SKEW).as_secs() as i64;
    let length = cert.not_after - cert.not_before;
    if length <= 0 {
        return Err(Dropped::Protocol(format!(
            "{node_id} presented an empty session certificate"
        )));
    }
    if length > longest {
        return Err(Dropped::Protocol(format!(
            "{node_id} presented a session certificate valid for longer than the allowed {} s",
            config.max_session_validity.as_secs()
        )));
    }
    let lease_ms = config.lease.as_millis() as u64;
    // A known node that says hello is alive: its lease is renewed with the next second's
    // heartbeats, not only once its session's open clears the group commit (which waited 16 s
    // behind 10 000 returning nodes in a 30 000-node rolling restart, and the leases of nodes
    // that had just left a session elsewhere ran out meanwhile).
    coordinator.beats().note(&node_id, lease_ms);
    let opened = match coordinator
        .commits()
        .submit(Change::OpenSession {
            node_id: node_id.clone(),
            lease_until_ms: now_ms() + lease_ms,
            at: coordinator.fleet().address().map(str::to_string),
            protocol,
        })
        .await
    {
        Err(e) => return Err(unavailable(&mut stream, e).await),
        Ok(opened) => opened,
    };
    let Applied::Generation(generation) = opened else {
        return Err(Dropped::Store(StoreError::Db(format!(
            "opening a session was answered with {opened:?}"
        ))));
    };
    // As the store says now (one started a moment ago is named too), and watched from before
    // the welcome names them, so no change in between goes untold.
    coordinator.learn_fleet_fresh().await;
    let mut members = coordinator.fleet().watch();
    let welcome = Down::Welcome {
        generation,
        heartbeat_ms: config.heartbeat.as_millis() as u64,
        lease_ms,
        coordinators: members.borrow_and_update().clone(),
        speaks: Versions::SPOKEN,
    };
    protocol::write_msg(&mut stream, &welcome).await?;
    tracing::info!(%node_id, generation, at = ?coordinator.fleet().address(), %protocol, "session open");
    let lapses = tokio::time::Instant::now() + Duration::from_secs(length as u64);
    let (calls_tx, calls) = mpsc::channel(16);
    let wake = Arc::new(Wake::default());
    let (handle, ending) = SessionHandle::new(generation, &cert.key, calls_tx, wake.clone());
    // Given up when the session ends, unless a newer session of the node took its place.
    let _registered = coordinator.sessions().register(&node_id, handle);
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
        members,
        slot: SlotWait::No,
        full_since: None,
        protocol,
    };
    // Boxed: a session's task would otherwise hold room for the welcome's futures beside the
    // serving loop's for as long as it lives (weeks), in every one of thousands of sessions.
    Box::pin(link.serve(reader, calls, &wake, ending, lapses, stopping)).await
}

/// A run's start, under an op id that stays the same in every session.
fn start_op(run_id: &RunId) -> OpId {
    OpId::new(format!("start-{run_id}"))
}

/// What an answered operation was for.
enum Pending {
    /// A stage, holding its place in the fetch window until answered, or until
    /// [`STAGE_SLOT_LIMIT`] has passed (a node that never answers must not keep it).
    Stage(Option<FetchSlot>, tokio::time::Instant),
    Start {
        run_id: RunId,
    },
    Call(oneshot::Sender<Answer>),
}

/// One node's live session on the coordinator side.
struct Link<'a, W> {
    coordinator: &'a Coordinator,
    node_id: NodeId,
    generation: u64,
    writer: W,
    lease_ms: u64,
    /// Programs sent to the node in this session.
    staged: HashSet<fleet_proto::Digest>,
    inflight: HashMap<OpId, Pending>,
    next_op: u64,
    /// The fleet's coordinators: the node is told whenever the set changes.
    members: watch::Receiver<Vec<String>>,
    /// Whether a run waits for a place in the fetch window, or holds the one that freed.
    slot: SlotWait,
    /// Since when the node has had no room for the runs that wait for it, as last read: a
    /// wake-up then changes nothing until a run ends or the capacity changes.
    full_since: Option<tokio::time::Instant>,
    /// The version the session speaks.
    protocol: ProtocolVersion,
}

/// A session's turn in the fetch window.
enum SlotWait {
    No,
    /// The next stage needs a place; the session takes the next that frees.
    Waiting,
    /// The place taken while waiting, for the next stage.
    Held(FetchSlot),
}

const BATCH: usize = 256;

/// How long a session whose write failed still reads what the node sent before the break.
const LAST_READS: Duration = Duration::from_secs(2);

/// How long a stage keeps its place in the fetch window without an answer: a fetch that takes
/// longer goes on, outside the window.
const STAGE_SLOT_LIMIT: Duration = Duration::from_secs(120);

impl<W: tokio::io::AsyncWrite + Unpin> Link<'_, W> {
    async fn serve<R: tokio::io::AsyncRead + Unpin + Send + 'static>(
        &mut self,
        reader: R,
        mut calls: mpsc::Receiver<NodeCall>,
        wake: &Wake,
        mut ending: watch::Receiver<Option<NodeEnd>>,
        lapses: tokio::time::Instant,
        mut stopping: Stopping,
    ) -> Result<(), Dropped> {
        let lease = Duration::from_millis(self.lease_ms);
        let node_id = self.node_id.clone();
        // A reader task of its own: a read cancelled halfway through a frame would lose it. The
        // messages are boxed: a channel allocates its slots in blocks, and an idle session should
        // hold a block of pointers, not of whole messages.
        let (tx, mut inbox) = mpsc::channel::<Box<Read>>(BATCH);
        // A heartbeat is noted as it is read: a session waiting on a slow store stays alive.
        let (beats, lease_ms) = (self.coordinator.beats().clone(), self.lease_ms);
        let gaps = self.coordinator.recorder().heartbeat_gaps();
        let reading = tokio::spawn(async move {
            let mut reader = reader;
            let mut last_beat = None;
            loop {
                let msg = protocol::read_msg::<_, serde_json::Value>(&mut reader)
                    .await
                    .map(|m| m.map(parse_up));
                if let Ok(Some(Inbound::Message(Up::Heartbeat))) = &msg {
                    beats.note(&node_id, lease_ms);
                    let now = tokio::time::Instant::now();
                    if let Some(last) = last_beat.replace(now) {
                        gaps.heard_after(now - last);
                    }
                }
                let end = !matches!(msg, Ok(Some(_)));
                if tx.send(Box::new(msg)).await.is_err() || end {
                    return;
                }
            }
        });
        let node_id = self.node_id.clone();
        let window = self.coordinator.fetch_window();
        // Kept across turns of the loop, so the session keeps its place in the window's queue.
        let mut next_slot: Option<Pin<Box<dyn Future<Output = FetchSlot> + Send + '_>>> = None;
        let mut told = stopping.clone();
        let work = async {
            self.dispatch().await?;
            loop {
                if matches!(self.slot, SlotWait::Waiting) && next_slot.is_none() {
                    next_slot = Some(Box::pin(window.take()));
                }
                tokio::select! {
                    Some(slot) = async { Some(next_slot.as_mut()?.await) }, if next_slot.is_some() => {
                        next_slot = None;
                        self.slot = SlotWait::Held(slot);
                        self.dispatch().await?;
                        // Given back when no run needed it after all.
                        if let SlotWait::Held(_) = self.slot {
                            self.slot = SlotWait::No;
                        }
                    }
                    _ = tokio::time::sleep_until(lapses) => {
                        return Err(Dropped::SessionEnded(format!("the session credential of {node_id} lapsed")));
                    }
                    () = stopped(&mut stopping) => {
                        tracing::info!(%node_id, generation = self.generation, "session closed: the coordinator stops serving");
                        if self.protocol >= ProtocolVersion::STOPPING_SAID {
                            protocol::write_msg(&mut self.writer, &Down::Stopping).await?;
                        }
                        return Ok(());
                    }
                    capacity_changed = wake.woken() => {
                        if capacity_changed {
                            self.full_since = None;
                        }
                        // Looked at again once a lease all the same: an end this session did not
                        // see (the operator's, through another coordinator) frees a slot too.
                        if self.full_since.is_none_or(|since| since.elapsed() >= lease) {
                            self.dispatch().await?;
                        }
                    }
                    Ok(()) = self.members.changed() => {
                        let coordinators = self.members.borrow_and_update().clone();
                        protocol::write_msg(&mut self.writer, &Down::Coordinators { coordinators }).await?;
                    }
                    end = ended_by_operator(&mut ending) => {
                        protocol::write_msg(&mut self.writer, &Down::Ended { end }).await?;
                        return Err(ended(&node_id, end));
                    }
                    Some(call) = calls.recv() => {
                        let (command, reply) = *call;
                        let op = self.op_id("call");
                        self.inflight.insert(op.clone(), Pending::Call(reply));
                        self.send(op, command).await?;
                    }
                    msg = tokio::time::timeout(lease, inbox.recv()) => {
                        let first = match msg.map(|m| m.map(|boxed| *boxed)) {
                            Err(_) => return Err(Dropped::SessionEnded(format!("{node_id} was silent for a whole lease"))),
                            Ok(None) => return Err(Dropped::SessionEnded(format!("the session of {node_id} ended"))),
                            Ok(Some(Err(e))) => return Err(Dropped::SessionEnded(format!("the session of {node_id} failed: {e}"))),
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
        };
        // A session still waiting on the store a moment after the stop is cut short there, as a
        // crash would cut it (what it had not answered, its node sends again), and told.
        let finished = {
            tokio::pin!(work);
            tokio::select! {
                biased;
                result = &mut work => Some(result),
                () = async {
                    stopped(&mut told).await;
                    tokio::time::sleep(STOP_PREEMPTS_AFTER).await;
                } => None,
            }
        };
        if let Some(Err(Dropped::Io(_) | Dropped::Frame(_))) = &finished {
            settle_calls_answered_before_the_break(&mut self.inflight, &mut inbox, LAST_READS)
                .await;
        }
        reading.abort();
        match finished {
            Some(result) => result,
            None => {
                tracing::info!(%node_id, generation = self.generation, "session closed: the coordinator stops serving (its store work cut short)");
                if self.protocol >= ProtocolVersion::STOPPING_SAID {
                    protocol::write_msg(&mut self.writer, &Down::Stopping).await?;
                }
                Ok(())
            }
        }
    }

    fn op_id(&mut self, kind: &str) -> OpId {
        self.next_op += 1;
        OpId::new(format!("{kind}-g{}-{}", self.generation, self.next_op))
    }

    async fn send(&mut self, op: OpId, command: Command) -> Result<(), Dropped> {
        let msg = Down::Command {
            op,
            generation: self.generation,
            command,
        };
        Ok(protocol::write_msg(&mut self.writer, &msg).await?)
    }

    /// Sends the runs waiting for this node that are not in flight yet, oldest first, as many as
    /// its capacity has room for, staging each program first. The rest stay waiting, queued for
    /// capacity, until a run of the node ends.
    async fn dispatch(&mut self) -> Result<(), Dropped> {
        self.free_stale_slots();
        let node_id = self.node_id.clone();
        let read = (self.coordinator)
            .with_store(move |store| store.dispatch_view(&node_id))
            .await;
        // A store that cannot be read now costs no session: the next wake-up or poll looks again.
        let (waiting, out, node) = match read {
            Ok(view) => view,
            Err(e) => {
                tracing::warn!(node_id = %self.node_id, "cannot read the runs waiting: {e}");
                return Ok(());
            }
        };
        // Taken by the node (out, not waiting), or sent and not answered yet: each holds a slot.
        let sent = (waiting.iter())
            .filter(|r| self.inflight.contains_key(&start_op(&r.id)))
            .count() as u64;
        let taken = out.saturating_sub(waiting.len() as u64);
        let mut room = match node.and_then(|n| n.capacity()) {
            Some(capacity) => u64::from(capacity).saturating_sub(taken + sent),
            None => u64::MAX,
        };
        self.full_since = None;
        for run in waiting {
            // Stable op ids: a start redelivered in a later session is answered from the node's record.
            let op = start_op(&run.id);
            if self.inflight.contains_key(&op) {
                continue;
            }
            if room == 0 {
                self.full_since = Some(tokio::time::Instant::now());
                break;
            }
            // The node fetches the content from this coordinator: without a reachable holder
            // the run waits (saying why) and is tried again at the next look.
            // Boxed: copying from a peer is a large future that every session's task would
            // otherwise hold room for; most runs find their content here and never use it.
            if let Err(reason) = Box::pin(self.content_ready(&run)).await {
                tracing::warn!(node_id = %self.node_id, run_id = %run.id, "a run waits for its content: {reason}");
                let (id, why) = (run.id.clone(), reason.to_string());
                let noted = (self.coordinator)
                    .with_store(move |store| store.note_waiting(&id, &why))
                    .await;
                if let Err(e) = noted {
                    tracing::warn!(run_id = %run.id, "cannot note why a run waits: {e}");
                }
                continue;
            }
            if let Workload::Program(program) = &run.workload
                && !self.staged.contains(program)
            {
                // The node fetches the program now: only with a place in the fetch window.
                let Some(slot) = self.fetch_slot() else {
                    break;
                };
                self.staged.insert(*program);
                let stage = Command::Stage { digest: *program };
                let stage_op = OpId::new(format!("stage-{}", program.hex()));
                let stage_pending = Pending::Stage(Some(slot), tokio::time::Instant::now());
                self.inflight.insert(stage_op.clone(), stage_pending);
                self.send(stage_op, stage).await?;
            }
            room -= 1;
            let registry_auth = if run.needs_registry_auth {
                let held = self.coordinator.credentials().for_start(&run.id);
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
            // Only a test build ever records one (`RunRequest::raw_command`).
            if let Some(raw) = run.raw_command.filter(|_| cfg!(debug_assertions)) {
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

    /// Gives back the window places of stages unanswered for [`STAGE_SLOT_LIMIT`].
    fn free_stale_slots(&mut self) {
        for pending in self.inflight.values_mut() {
            if let Pending::Stage(slot @ Some(_), since) = pending
                && since.elapsed() > STAGE_SLOT_LIMIT
            {
                *slot = None;
                tracing::warn!(node_id = %self.node_id, "a stage unanswered for {} s gave back its place in the fetch window", STAGE_SLOT_LIMIT.as_secs());
            }
        }
    }

    /// A place in the fetch window: the one taken while waiting, or a free one; with none, the
    /// session waits for the next that frees and dispatches again then.
    fn fetch_slot(&mut self) -> Option<FetchSlot> {
        let slot = match std::mem::replace(&mut self.slot, SlotWait::No) {
            SlotWait::Held(slot) => Some(slot),
            SlotWait::No | SlotWait::Waiting => self.coordinator.fetch_window().try_take(),
        };
        if slot.is_none() {
            self.slot = SlotWait::Waiting;
        }
        slot
    }

    /// Sends `raw` as the command object of a command message, unchecked: what a coordinator of
    /// another protocol version could send (for protocol-skew testing).
    async fn send_raw(&mut self, op: OpId, raw: serde_json::Value) -> Result<(), Dropped> {
        // The envelope comes from the protocol's own type; only its command object is replaced.
        let envelope = Down::Command {
            op,
            generation: self.generation,
            command: Command::Facts,
        };
        // Cannot fail: protocol messages are plain data with string keys, which always serialize.
        let mut msg = serde_json::to_value(envelope).expect("protocol messages serialize");
        msg["command"] = raw;
        Ok(protocol::write_msg(&mut self.writer, &msg).await?)
    }

    async fn handle(&mut self, batch: Vec<Inbound>) -> Result<(), Dropped> {
        // Heartbeats come every few seconds: a node whose stage never comes back frees its place.
        self.free_stale_slots();
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
                    return Err(Dropped::Protocol(format!(
                        "{} sent a malformed message: {reason}",
                        self.node_id
                    )));
                }
            };
            match msg {
                Up::Event { event } => events.push(NodeEvent::Known(event)),
                // Noted by the reader already; here it only proves the session alive.
                Up::Heartbeat => {}
                Up::Facts { facts } => {
                    // The capacity the agent declares may have changed.
                    self.full_since = None;
                    self.heartbeat(facts).await?;
                }
                Up::Result { op, answer } => self.answered(&op, answer, &mut accepted),
                _ => {
                    return Err(Dropped::Protocol(format!(
                        "{} sent a message that does not belong in a session",
                        self.node_id
                    )));
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
            let Applied::Events { up_to, moved } = self.commit(change).await? else {
                return Err(Dropped::Store(StoreError::Db(
                    "storing events was answered with something else".into(),
                )));
            };
            self.coordinator.recorder().runs_moved(&moved);
            protocol::write_msg(&mut self.writer, &Down::Ack { up_to }).await?;
            // A run that ended frees a slot of the node's capacity for the next one waiting.
            if moved.iter().any(|m| m.state.is_final()) {
                self.dispatch().await?;
            }
        }
        Ok(())
    }

    /// A heartbeat heard now, and the lease it extends.
    fn beat(&self) -> Beat {
        beat_now(&self.node_id, self.lease_ms)
    }

    /// Records new facts, with the heartbeat they are.
    async fn heartbeat(&self, facts: fleet_proto::facts::Facts) -> Result<(), Dropped> {
        let beat = self.beat();
        self.commit(Change::Facts {
            beat,
            facts: Box::new(facts),
        })
        .await
        .map(drop)
    }

    async fn commit(&self, change: Change) -> Result<Applied, Dropped> {
        Ok(self.coordinator.commits().submit(change).await?)
    }

    /// Whether this coordinator holds every blob the run needs, copied from another coordinator
    /// of the fleet when it did not.
    async fn content_ready(
        &self,
        run: &crate::store::RunRow,
    ) -> Result<(), crate::error::PeerError> {
        for digest in run.content() {
            self.coordinator.ensure_blob(&digest).await?;
        }
        Ok(())
    }

    /// A run whose registry credential is gone (the coordinator restarted before the node took
    /// it): failed with the reason, since the credential was never stored.
    async fn fail_without_credential(&mut self, run_id: &RunId) -> Result<(), Dropped> {
        let id = run_id.clone();
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
            .map_err(Dropped::Store)
    }

    /// Settles an answered operation; start answers are gathered for one transaction.
    fn answered(&mut self, op: &OpId, answer: Answer, accepted: &mut Vec<(RunId, Option<String>)>) {
        let error = answer.as_ref().err().map(|r| r.message.clone());
        match self.inflight.remove(op) {
            Some(Pending::Start { run_id }) => {
                // The node has the run now: its credential is no longer needed anywhere here.
                self.coordinator.credentials().release(&run_id);
                accepted.push((run_id, error));
            }
            Some(Pending::Stage(..)) => {
                if let Some(e) = error {
                    tracing::warn!(node_id = %self.node_id, "staging failed: {e}");
                }
            }
            Some(Pending::Call(reply)) => {
                let _ = reply.send(answer);
            }
            None => tracing::debug!(%op, "an answer to an operation not in flight"),
        }
    }
}

/// Hands the calls' callers the answers the node sent before its connection broke under a
/// write: an agent that answers `update` and restarts at once leaves its answer here, read or
/// about to be, while the next command written finds the connection gone.
async fn settle_calls_answered_before_the_break(
    inflight: &mut HashMap<OpId, Pending>,
    inbox: &mut mpsc::Receiver<Box<Read>>,
    patience: Duration,
) {
    let until = tokio::time::Instant::now() + patience;
    while let Ok(Some(read)) = tokio::time::timeout_at(until, inbox.recv()).await {
        match *read {
            Ok(Some(Inbound::Message(Up::Result { op, answer }))) => {
                if let Some(Pending::Call(reply)) = inflight.remove(&op) {
                    let _ = reply.send(answer);
                }
            }
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => return,
        }
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
    // Read from a borrow: the value is kept, uncopied, for the one message in many that fails.
    match <Up as serde::Deserialize>::deserialize(&value) {
        Ok(msg) => Inbound::Message(msg),
        Err(e) => match value
            .get("event")
            .filter(|_| value.get("type").and_then(|t| t.as_str()) == Some("event"))
            .and_then(|ev| unreadable_event(ev, &e))
        {
            Some(event) => Inbound::UnreadableEvent(event),
            None => Inbound::Malformed(e.to_string()),
        },
    }
}

/// An event whose envelope is intact (id, run) but whose content does not parse.
fn unreadable_event(event: &serde_json::Value, error: &serde_json::Error) -> Option<NodeEvent> {
    let id = event.get("id")?.as_u64()?;
    let run_id = RunId::parse(event.get("run_id")?.as_str()?).ok()?;
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
    use fleet_proto::protocol::Reply;

    #[tokio::test]
    async fn a_call_answered_just_before_the_connection_broke_reaches_its_caller() {
        let (tx, mut inbox) = mpsc::channel::<Box<Read>>(4);
        let (reply, answer) = oneshot::channel();
        let (left, _unanswered) = oneshot::channel();
        let mut inflight = HashMap::from([
            (OpId::new("call-g1-1"), Pending::Call(reply)),
            (OpId::new("call-g1-2"), Pending::Call(left)),
        ]);
        let updating = Up::Result {
            op: OpId::new("call-g1-1"),
            answer: Ok(Reply::Updating { from: 0, to: 5 }),
        };
        tx.send(Box::new(Ok(Some(Inbound::Message(Up::Heartbeat)))))
            .await
            .unwrap();
        tx.send(Box::new(Ok(Some(Inbound::Message(updating)))))
            .await
            .unwrap();
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        tx.send(Box::new(Err(protocol::FrameError::from(reset))))
            .await
            .unwrap();
        settle_calls_answered_before_the_break(&mut inflight, &mut inbox, LAST_READS).await;
        assert!(matches!(
            answer.await,
            Ok(Ok(Reply::Updating { from: 0, to: 5 }))
        ));
        // The call the node never answered stays for the session's end to drop.
        assert!(inflight.contains_key(&OpId::new("call-g1-2")));
    }

    #[tokio::test(start_paused = true)]
    async fn a_reader_that_hears_nothing_more_is_waited_for_no_longer_than_the_patience() {
        let (_tx, mut inbox) = mpsc::channel::<Box<Read>>(4);
        let began = tokio::time::Instant::now();
        settle_calls_answered_before_the_break(&mut HashMap::new(), &mut inbox, LAST_READS).await;
        assert_eq!(began.elapsed(), LAST_READS);
    }

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
