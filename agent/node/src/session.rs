//! The agent's session: an authenticated connection from the node key, facts on open, heartbeats
//! at the coordinator's interval, commands answered from the node, spooled events replayed and
//! sent as they happen, a fresh credential before the current one lapses, and reconnection with
//! capped backoff and jitter, logged every time.
use crate::backoff::Backoff;
use crate::dial::{self, Coordinators, DialError, Dialed};
use crate::facts::FactsSource;
use crate::identity::{Identity, Membership};
use crate::node::Node;
use fleet_cli::blocking::{Unfinished, off_thread};
use fleet_proto::protocol::{
    self, Answer, Command, Down, FrameError, NodeEnd, Opening, Refusal, RefusalClass, Reply, Up,
};
use fleet_proto::version::{Incompatible, Versions};
use fleet_proto::{OpId, RunId};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncWrite;
use tokio::task::JoinSet;

const WELCOME_TIMEOUT: Duration = Duration::from_secs(15);
/// Events sent per batch when replaying the spool.
const EVENT_BATCH: usize = 256;
/// Starts executed at once.
const MAX_STARTING: usize = 4;
/// Commands executed at once, starts included.
const MAX_WORKING: usize = 16;

/// A command that ran beside the loop: its op, its answer, and what it held up while it ran.
struct Done {
    op: OpId,
    answer: Answer,
    held: Holds,
}

/// What a command in flight holds up: commands about a run wait for its start, starts wait for
/// the programs being staged (the start may need one of them).
#[derive(Clone)]
enum Holds {
    Start(RunId),
    Stage,
    Nothing,
}

/// The commands running beside the session loop.
#[derive(Default)]
struct Working {
    tasks: JoinSet<Done>,
    /// Runs whose start is in flight.
    starting: std::collections::HashSet<RunId>,
    /// Stages in flight.
    staging: usize,
    /// Commands waiting for what they follow, in arrival order.
    deferred: std::collections::VecDeque<(OpId, u64, Command)>,
}

impl Working {
    fn hold(&mut self, held: &Holds) {
        match held {
            Holds::Start(run) => {
                self.starting.insert(run.clone());
            }
            Holds::Stage => self.staging += 1,
            Holds::Nothing => {}
        }
    }

    fn release(&mut self, held: &Holds) {
        match held {
            Holds::Start(run) => {
                self.starting.remove(run);
            }
            Holds::Stage => self.staging -= 1,
            Holds::Nothing => {}
        }
    }
}

#[derive(Debug, Clone)]
pub struct SessionSettings {
    /// How long each session certificate is valid; a new one is minted at two thirds of it.
    pub validity: Duration,
    pub retry_base: Duration,
}

/// A connection whose coordinator has welcomed the node: its next session.
struct Greeted {
    stream: tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
    /// When the connection was made: its certificate's validity counts from then.
    dialed_at: tokio::time::Instant,
    generation: u64,
    heartbeat_ms: u64,
    lease_ms: u64,
    coordinators: Vec<String>,
    protocol: fleet_proto::version::ProtocolVersion,
}

/// The coordinator the node joined through, having welcomed it while its session elsewhere went on.
struct HomeGreeted(Box<Greeted>);

impl std::fmt::Debug for HomeGreeted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HomeGreeted")
    }
}

/// Why one session ended.
#[derive(Debug, thiserror::Error)]
enum Ended {
    #[error("the credential is due for renewal")]
    Renew,
    #[error("the coordinator it joined through answers again")]
    Home(HomeGreeted),
    #[error(transparent)]
    Dial(DialError),
    #[error(
        "the coordinator closed the session (it does not know this node, or its credential lapsed)"
    )]
    Refused,
    #[error("the coordinator closed the session")]
    Closed,
    #[error("the coordinator stops serving (its operator stopped or restarted it)")]
    Stopping,
    #[error("the session failed: {0}")]
    Frame(#[from] FrameError),
    #[error("no welcome from the coordinator within {} s", WELCOME_TIMEOUT.as_secs())]
    NoWelcome,
    #[error("the node store failed: {0}")]
    Store(String),
    #[error("the fleet's operator {} this node", .0.as_str())]
    ByOperator(NodeEnd),
    #[error("the coordinator cannot serve a session now: {0}")]
    Unavailable(String),
    #[error("the coordinator refused the session: {0}")]
    Incompatible(Incompatible),
}

/// Keeps a session open for as long as the process lives; returns only once the fleet's
/// operator ended the node (retired or revoked it), or on a fatal error.
pub async fn run(
    identity: &Identity,
    membership: &Membership,
    coordinators: &Coordinators,
    remember: &(dyn Fn(Vec<String>) + Sync),
    facts: &FactsSource,
    node: &Arc<Node>,
    settings: &SessionSettings,
) -> Result<NodeEnd, DialError> {
    let pinned = membership.coordinator_key.as_bytes().to_vec();
    let mut backoff = Backoff::new(settings.retry_base);
    let mut home = None;
    loop {
        let session = Session {
            identity,
            membership,
            coordinators,
            remember,
            pinned: &pinned,
            facts,
            node,
            settings,
        };
        match session.run(&mut backoff, home.take()).await {
            Ended::Renew => tracing::info!("session credential renewed"),
            Ended::Home(HomeGreeted(greeted)) => {
                coordinators.go_home();
                home = Some(*greeted);
                tracing::info!(home = %coordinators.current(), "going back to the coordinator it joined through");
            }
            Ended::Dial(e) if e.is_fatal() => return Err(e),
            Ended::ByOperator(end) => return Ok(end),
            ended => {
                let address = coordinators.current();
                if matches!(ended, Ended::Stopping) {
                    coordinators.stopping();
                }
                // The fleet's coordinators are equivalent: the next try goes to the next one,
                // unless this one said it stops just now (it may be restarting).
                let delay = coordinators.advance_after(&mut backoff);
                tracing::warn!(
                    %address,
                    next = %coordinators.current(),
                    retry_in_ms = delay.as_millis() as u64,
                    "session lost: {ended}; reconnecting"
                );
                tokio::time::sleep(delay).await;
            }
        }
    }
}

struct Session<'a> {
    identity: &'a Identity,
    membership: &'a Membership,
    coordinators: &'a Coordinators,
    remember: &'a (dyn Fn(Vec<String>) + Sync),
    pinned: &'a [u8],
    facts: &'a FactsSource,
    node: &'a Arc<Node>,
    settings: &'a SessionSettings,
}

impl Session<'_> {
    /// One session at the current coordinator, over `ready` when it welcomed the node already.
    async fn run(&self, backoff: &mut Backoff, ready: Option<Greeted>) -> Ended {
        let greeted = match ready {
            Some(greeted) => greeted,
            None => match self.dial(self.coordinators.current()).await {
                Ok(dialed) => match self.greet(dialed).await {
                    Ok(greeted) => greeted,
                    Err(ended) => return ended,
                },
                Err(e) => return Ended::Dial(e),
            },
        };
        let Greeted {
            stream,
            dialed_at: started,
            generation,
            heartbeat_ms,
            lease_ms,
            coordinators,
            protocol,
        } = greeted;
        self.coordinators.welcomed(Duration::from_millis(lease_ms));
        if self.coordinators.learn(&coordinators) {
            (self.remember)(self.coordinators.all());
        }
        let node = self.node.clone();
        if let Err(e) = blocking(move || node.check_generation(generation)).await {
            return Ended::Store(e);
        }
        backoff.reset();
        if let Some(releases) = self.node.releases()
            && releases.confirm_blame()
        {
            tracing::warn!(
                "the restored agent holds a session: the reverted release is blamed, never tried again"
            );
        }
        self.node.set_in_session(true);
        tracing::info!(generation, node_id = %self.membership.node_id, coordinator = %self.coordinators.current(), %protocol, "session open");
        let (reader, mut writer) = tokio::io::split(stream);
        // A reader task of its own: a read cancelled halfway through a frame would lose it.
        let (tx, mut inbox) = tokio::sync::mpsc::channel::<Inbound>(64);
        // Noted as it is read: a heartbeat written meanwhile to the closing stream must not pass
        // for a coordinator that died.
        let said_stopping = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopping = said_stopping.clone();
        let reading = tokio::spawn(async move {
            let mut reader = reader;
            loop {
                let msg = protocol::read_msg::<_, serde_json::Value>(&mut reader).await;
                let end = !matches!(msg, Ok(Some(_)));
                let msg = msg.map(|m| m.map(parse_down));
                if let Ok(Some(Ok(Down::Stopping))) = msg {
                    stopping.store(true, std::sync::atomic::Ordering::SeqCst);
                }
                if tx.send(msg).await.is_err() || end {
                    return;
                }
            }
        });
        let mut ended = self
            .serve(&mut writer, &mut inbox, generation, heartbeat_ms, started)
            .await;
        let went = matches!(ended, Ended::Home(_) | Ended::ByOperator(_));
        if said_stopping.load(std::sync::atomic::Ordering::SeqCst) && !went {
            ended = Ended::Stopping;
        }
        self.node.set_in_session(false);
        reading.abort();
        ended
    }

    /// Says hello on a new connection and reads the coordinator's welcome.
    async fn greet(&self, mut dialed: Dialed) -> Result<Greeted, Ended> {
        let dialed_at = tokio::time::Instant::now();
        let stream = &mut dialed.stream;
        let hello = Up::Hello {
            node_id: self.membership.node_id.clone(),
        };
        protocol::write_msg(stream, &Opening::new(hello)).await?;
        let welcome = match tokio::time::timeout(
            WELCOME_TIMEOUT,
            protocol::read_msg::<_, Down>(stream),
        )
        .await
        {
            Err(_) => return Err(Ended::NoWelcome),
            Ok(Err(_) | Ok(None)) => return Err(Ended::Refused),
            Ok(Ok(Some(msg))) => msg,
        };
        match welcome {
            Down::Ended { end } => return Err(Ended::ByOperator(end)),
            Down::Unavailable { message } => return Err(Ended::Unavailable(message)),
            Down::Incompatible { versions } => return Err(Ended::Incompatible(versions)),
            _ => {}
        }
        let Down::Welcome {
            generation,
            heartbeat_ms,
            lease_ms,
            coordinators,
            speaks,
            ..
        } = welcome
        else {
            return Err(Ended::Refused);
        };
        // A coordinator that welcomes a version it does not share is wrong; say so, never guess.
        let Some(protocol) = Versions::SPOKEN.common(speaks) else {
            return Err(Ended::Incompatible(Incompatible {
                agent: Versions::SPOKEN,
                coordinator: speaks,
            }));
        };
        Ok(Greeted {
            stream: dialed.stream,
            dialed_at,
            generation,
            heartbeat_ms,
            lease_ms,
            coordinators,
            protocol,
        })
    }

    async fn dial(&self, address: String) -> Result<Dialed, DialError> {
        dial::dial(&address, self.identity, self.pinned, self.settings.validity).await
    }

    async fn serve<W: AsyncWrite + Unpin>(
        &self,
        writer: &mut W,
        inbox: &mut tokio::sync::mpsc::Receiver<Inbound>,
        generation: u64,
        heartbeat_ms: u64,
        started: tokio::time::Instant,
    ) -> Ended {
        let facts = Up::Facts {
            facts: self.facts.collect(self.node.holdings()).await,
        };
        if let Err(e) = protocol::write_msg(writer, &facts).await {
            return e.into();
        }
        // Everything not yet acked is sent again: the coordinator dedupes by id.
        let mut sent_up_to = 0;
        if let Err(ended) = self.send_events(writer, &mut sent_up_to).await {
            return ended;
        }
        let renew_at = started + self.settings.validity.mul_f64(2.0 / 3.0);
        let mut heartbeat = tokio::time::interval(Duration::from_millis(heartbeat_ms.max(50)));
        heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        heartbeat.tick().await;
        // Commands run beside the loop, so heartbeats go on while a stop waits out its grace.
        // Starts run side by side (their supervisors spawn while the store syncs); a command
        // about a run waits for that run's start, so it never overtakes the start it follows.
        let mut working = Working::default();
        let changes = self.node.changes();
        // Home is left for only once it has welcomed the node: no moment without a session.
        let home = self.coordinators.dial_home(|home| async move {
            let dialed = self.dial(home).await.map_err(drop)?;
            self.greet(dialed).await.map_err(drop)
        });
        tokio::pin!(home);
        loop {
            tokio::select! {
                Some(done) = working.tasks.join_next(), if !working.tasks.is_empty() => {
                    if let Err(ended) = self.answer(writer, &mut working, done, &mut sent_up_to).await {
                        return ended;
                    }
                    self.spawn_ready(&mut working);
                }
                runs = changed(changes.as_ref()) => {
                    if let Err(ended) = self.sync_changed(writer, &working, runs, &mut sent_up_to).await {
                        return ended;
                    }
                }
                _ = heartbeat.tick() => {
                    if let Err(e) = protocol::write_msg(writer, &Up::Heartbeat).await {
                        return e.into();
                    }
                    if let Err(ended) = self.watch(writer, &mut sent_up_to).await {
                        return ended;
                    }
                }
                _ = tokio::time::sleep_until(renew_at) => return Ended::Renew,
                _ = self.node.facts_changed() => {
                    let facts = Up::Facts { facts: self.facts.collect(self.node.holdings()).await };
                    if let Err(e) = protocol::write_msg(writer, &facts).await {
                        return e.into();
                    }
                }
                greeted = &mut home => return Ended::Home(HomeGreeted(Box::new(greeted))),
                msg = inbox.recv() => match msg {
                    None | Some(Ok(None)) => return Ended::Closed,
                    Some(Err(e)) => return e.into(),
                    Some(Ok(Some(Err((op, reason))))) => {
                        tracing::warn!(%op, "a malformed command: {reason}");
                        let answer = Err(Refusal::new(RefusalClass::Malformed, format!("a malformed command: {reason}")));
                        if let Err(e) = protocol::write_msg(writer, &Up::Result { op, answer }).await {
                            return e.into();
                        }
                    }
                    Some(Ok(Some(Ok(Down::Command { op, generation: g, command })))) => {
                        if let Err(ended) = self.dispatch(writer, &mut working, op, g, command).await {
                            return ended;
                        }
                    }
                    Some(Ok(Some(Ok(Down::Ended { end })))) => return Ended::ByOperator(end),
                    Some(Ok(Some(Ok(Down::Stopping)))) => return Ended::Stopping,
                    Some(Ok(Some(Ok(Down::Coordinators { coordinators })))) => {
                        // Kept with the membership, so a restarted agent knows them too.
                        if self.coordinators.learn(&coordinators) {
                            tracing::info!(?coordinators, "learned the fleet's coordinators");
                            (self.remember)(self.coordinators.all());
                        }
                    }
                    Some(Ok(Some(Ok(Down::Ack { up_to })))) => {
                        let node = self.node.clone();
                        if let Err(e) = blocking(move || node.ack_events(up_to)).await {
                            return Ended::Store(e);
                        }
                    }
                    Some(Ok(Some(Ok(other)))) => tracing::debug!(?other, generation, "ignoring an unexpected message"),
                },
            }
        }
    }

    /// Starts one command beside the loop (facts, which the session sends itself, in order). A
    /// command that must wait (a start while programs are being staged, a command about a run
    /// whose start is in flight, or a full house) waits in order in `deferred`, so the loop goes
    /// on with heartbeats however long a stage takes.
    async fn dispatch<W: AsyncWrite + Unpin>(
        &self,
        writer: &mut W,
        working: &mut Working,
        op: OpId,
        generation: u64,
        command: Command,
    ) -> Result<(), Ended> {
        if let Command::Facts = command {
            return self.send_facts(writer, op).await;
        }
        working.deferred.push_back((op, generation, command));
        self.spawn_ready(working);
        Ok(())
    }

    /// Starts the waiting commands, oldest first, up to the first that must still wait.
    fn spawn_ready(&self, working: &mut Working) {
        if working.tasks.is_empty() {
            // Nothing left running: a command that crashed holds nothing up any more.
            working.starting.clear();
            working.staging = 0;
        }
        while let Some((_, _, command)) = working.deferred.front() {
            let held = match command {
                Command::Stage { .. } => Holds::Stage,
                Command::Start(start) => {
                    if working.staging > 0 || working.starting.len() >= MAX_STARTING {
                        return;
                    }
                    Holds::Start(start.run_id.clone())
                }
                Command::Stop { run_id }
                | Command::Status { run_id }
                | Command::Collect { run_id, .. } => {
                    if working.starting.contains(run_id) {
                        return;
                    }
                    Holds::Nothing
                }
                Command::Facts
                | Command::Replicate { .. }
                | Command::Update { .. }
                | Command::Check(_) => Holds::Nothing,
            };
            if working.tasks.len() >= MAX_WORKING {
                return;
            }
            // Cannot fail: the loop's condition checked the queue is not empty.
            let (op, generation, command) = working.deferred.pop_front().expect("a front");
            working.hold(&held);
            let node = self.node.clone();
            working.tasks.spawn(async move {
                let answer = node.execute(op.as_str(), generation, &command).await;
                Done { op, answer, held }
            });
        }
    }

    /// Sends the answer of a command that ran beside the loop, then whatever events it spooled.
    async fn answer<W: AsyncWrite + Unpin>(
        &self,
        writer: &mut W,
        working: &mut Working,
        done: Result<Done, tokio::task::JoinError>,
        sent_up_to: &mut u64,
    ) -> Result<(), Ended> {
        match done {
            Ok(Done { op, answer, held }) => {
                working.release(&held);
                let started = answer.is_ok();
                let swapped = match (&answer, self.node.releases()) {
                    (Ok(Reply::Updating { to, .. }), Some(r)) => r.started_as != *to,
                    _ => false,
                };
                protocol::write_msg(writer, &Up::Result { op, answer }).await?;
                if swapped && let Some(releases) = self.node.releases() {
                    // The answer is out; the watchdog watches this process, which becomes the new agent.
                    let e = releases.exec();
                    tracing::error!("cannot restart into the new release: {e}");
                }
                // A run just launched is looked at once now, so `running` goes out with its
                // answer instead of at the next heartbeat.
                if let (Holds::Start(run), true) = (held, started) {
                    let node = self.node.clone();
                    let report = blocking(move || node.sync_run(&run))
                        .await
                        .map_err(Ended::Store)?;
                    for e in report.errors {
                        tracing::warn!("cannot read a run's state: {e}");
                    }
                }
            }
            // Its op is not recorded, so the coordinator sends it again in the next session; what
            // it held stays held until nothing runs, so nothing overtakes the redelivery.
            Err(e) => tracing::error!("a command crashed: {e}"),
        }
        self.send_events(writer, sent_up_to).await
    }

    /// Sends fresh facts, then the answer to the command that asked for them.
    async fn send_facts<W: AsyncWrite + Unpin>(
        &self,
        writer: &mut W,
        op: OpId,
    ) -> Result<(), Ended> {
        let facts = self.facts.collect(self.node.holdings()).await;
        protocol::write_msg(writer, &Up::Facts { facts }).await?;
        let answer = Ok(Reply::FactsSent);
        protocol::write_msg(writer, &Up::Result { op, answer }).await?;
        Ok(())
    }

    /// Syncs the runs the runtime noted as changed (a container that ended), then sends, so
    /// an end is reported as it happens rather than at the next watch. A run whose start is in
    /// flight is left to the start's answer, which syncs it.
    async fn sync_changed<W: AsyncWrite + Unpin>(
        &self,
        writer: &mut W,
        working: &Working,
        runs: std::collections::BTreeSet<RunId>,
        sent_up_to: &mut u64,
    ) -> Result<(), Ended> {
        let runs: Vec<RunId> = runs
            .into_iter()
            .filter(|run| !working.starting.contains(run))
            .collect();
        let node = self.node.clone();
        let errors = blocking(move || {
            let mut errors = Vec::new();
            for run in &runs {
                errors.extend(node.sync_run(run)?.errors);
            }
            Ok::<_, crate::state::StateError>(errors)
        })
        .await
        .map_err(Ended::Store)?;
        for e in errors {
            tracing::warn!("cannot read a run's state: {e}");
        }
        self.send_events(writer, sent_up_to).await
    }

    /// Brings the spool up to date with the runtime (re-adoption and watching), then sends.
    async fn watch<W: AsyncWrite + Unpin>(
        &self,
        writer: &mut W,
        sent_up_to: &mut u64,
    ) -> Result<(), Ended> {
        let node = self.node.clone();
        let (report, tidied) = blocking(move || {
            let report = node.sync_runs()?;
            let tidied = node.tidy();
            node.prune_content_when_due();
            Ok::<_, crate::state::StateError>((report, tidied))
        })
        .await
        .map_err(Ended::Store)?;
        for e in report.errors {
            tracing::warn!("cannot read a run's state: {e}");
        }
        if let Err(e) = tidied {
            tracing::warn!("cannot clean up the runtime's leftovers: {e}");
        }
        self.send_events(writer, sent_up_to).await
    }

    async fn send_events<W: AsyncWrite + Unpin>(
        &self,
        writer: &mut W,
        sent_up_to: &mut u64,
    ) -> Result<(), Ended> {
        loop {
            let node = self.node.clone();
            let after = *sent_up_to;
            let events = blocking(move || node.pending_events(after, EVENT_BATCH))
                .await
                .map_err(Ended::Store)?;
            let Some(last) = events.last().map(|e| e.id) else {
                return Ok(());
            };
            for event in events {
                protocol::write_msg(writer, &Up::Event { event }).await?;
            }
            *sent_up_to = last;
        }
    }
}

/// A message from the coordinator: a well-formed one, or the op id and reason of a malformed one
/// (framing is intact, so the session goes on and the command gets an error answer).
type Inbound = Result<Option<Result<Down, (OpId, String)>>, FrameError>;

fn parse_down(value: serde_json::Value) -> Result<Down, (OpId, String)> {
    let op = value
        .get("op")
        .and_then(|o| o.as_str())
        .map(OpId::new)
        .unwrap_or_else(|| OpId::new(""));
    serde_json::from_value(value).map_err(|e| (op, e.to_string()))
}

/// The runs the runtime noted as changed; never ready for a runtime that notes none.
async fn changed(changes: Option<&crate::runtime::Changes>) -> std::collections::BTreeSet<RunId> {
    match changes {
        Some(changes) => changes.next().await,
        None => std::future::pending().await,
    }
}

/// Runs a blocking store call off the async thread; errors come back as one line.
async fn blocking<T: Send + 'static, E: std::fmt::Display + Send + 'static>(
    f: impl FnOnce() -> Result<T, E> + Send + 'static,
) -> Result<T, String> {
    let done = off_thread(move || Ok::<_, Unfinished>(f())).await;
    done.map_err(|e| e.to_string())?.map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_malformed_command_keeps_its_op_id_for_the_error_answer() {
        let bad = serde_json::json!({ "type": "command", "op": "op-7", "generation": 1, "command": { "kind": "launch_missiles" } });
        let (op, reason) = parse_down(bad).unwrap_err();
        assert_eq!(op, "op-7");
        assert!(reason.contains("launch_missiles"), "{reason}");
        let good = serde_json::json!({ "type": "ack", "up_to": 3 });
        assert!(matches!(parse_down(good), Ok(Down::Ack { up_to: 3 })));
    }
}
