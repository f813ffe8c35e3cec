//! The node's work: each command executed against the runtime and recorded in the node's store
//! before it is answered, so a redelivered command is answered from the record, never redone.
use crate::content::ContentLink;
use crate::facts::LinkMeter;
use crate::fetched::Fetched;
use crate::runtime::{RunReport, RunSpec, RunState, Runtime, RuntimeError, Started, SyncReport};
use crate::state::{Launch, StateError, Store};
use fleet_cli::blocking::{Unfinished, off_thread};
use fleet_content::{Blobs, ContentError};
use fleet_proto::protocol::{Answer, Command, MintedRead, Refusal, RefusalClass, Reply, StartRun};
use fleet_proto::run::{Event, Workload};
use fleet_proto::{Digest, RunId, UploadId};
use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

static COLLECTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Temporary files of the node under its state folder: programs being staged, inputs, collects.
pub fn scratch_dir(state: &Path) -> PathBuf {
    state.join("scratch")
}

/// The node's content by digest (programs, inputs), whole and checked, under its state folder.
pub fn content_blobs(state: &Path) -> Blobs {
    Blobs::new(state.join("content"))
}

/// The node's durable store and its runtime.
pub struct Node {
    store: Arc<Store>,
    runtime: Arc<dyn Runtime>,
    /// Temporary files (programs being staged, inputs, collected files); never secrets.
    scratch: PathBuf,
    /// Content held whole and checked, by digest.
    blobs: Blobs,
    /// How content reaches the node and collected files leave it; None until it has joined.
    content: Option<ContentLink>,
    /// Where artifacts are replicated to, and the meter their copies are timed into.
    artifacts: Option<(Blobs, Arc<LinkMeter>)>,
    /// A lock per digest being fetched.
    fetching: std::sync::Mutex<std::collections::HashMap<Digest, Arc<tokio::sync::Mutex<()>>>>,
    /// When the content was last pruned.
    pruned_at: std::sync::Mutex<Option<Instant>>,
    /// Where its releases live; None refuses updates.
    releases: Option<crate::update::Releases>,
    /// The run store, whose disk the checks measure (the content store's when None).
    run_store: Option<PathBuf>,
    /// Whether a session is open now (what a new release's trial waits for).
    in_session: std::sync::atomic::AtomicBool,
    /// Told when the facts changed outside a session's reading of them (a release kept).
    facts_changed: tokio::sync::Notify,
}

/// What the session and the agent ask of the node: its spool, its runs as the runtime sees them,
/// its releases, and whether a session is open.
impl Node {
    /// The node's durable records, for a tool or a test that reads or writes them outside a
    /// session.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Refuses a session generation older than the newest seen (a stale coordinator's).
    pub fn check_generation(&self, generation: u64) -> Result<(), StateError> {
        self.store.check_generation(generation)
    }

    /// Up to `limit` spooled events after `after`, oldest first.
    pub fn pending_events(&self, after: u64, limit: usize) -> Result<Vec<Event>, StateError> {
        self.store.pending_events(after, limit)
    }

    /// Trims the spool up to the event the coordinator stored.
    pub fn ack_events(&self, up_to: u64) -> Result<u64, StateError> {
        self.store.ack_events(up_to)
    }

    /// Every run's record brought up to date with the runtime (re-adoption and watching).
    pub fn sync_runs(&self) -> Result<SyncReport, StateError> {
        crate::runtime::sync_runs(&self.store, self.runtime.as_ref())
    }

    /// One run's record brought up to date with the runtime.
    pub fn sync_run(&self, run: &RunId) -> Result<SyncReport, StateError> {
        crate::runtime::sync_run(&self.store, self.runtime.as_ref(), run)
    }

    /// The runtime's leftovers of runs the records call done, removed; the runs tidied.
    pub fn tidy(&self) -> Result<Vec<RunId>, RuntimeError> {
        let record = |run: &RunId| self.store.run(run).ok().flatten().map(|r| r.state);
        self.runtime.tidy(&record)
    }

    /// Where the runtime notes runs that changed on their own, if it does.
    pub fn changes(&self) -> Option<crate::runtime::Changes> {
        self.runtime.changes()
    }

    /// Stops every run the node holds, each the way its timeout would.
    pub fn stop_runs(&self) {
        let runs = match self.store.active_runs() {
            Ok(runs) => runs,
            Err(e) => return tracing::warn!("cannot list the runs to stop: {e}"),
        };
        for run in runs {
            if let Err(e) = self.runtime.stop(&run.run_id) {
                tracing::warn!(run_id = %run.run_id, "cannot stop a run: {e}");
            }
        }
    }

    /// Where its releases live; None refuses updates.
    pub fn releases(&self) -> Option<&crate::update::Releases> {
        self.releases.as_ref()
    }

    /// A session opened (true) or closed (false): what a new release's trial waits for.
    pub fn set_in_session(&self, open: bool) {
        self.in_session
            .store(open, std::sync::atomic::Ordering::SeqCst);
    }

    pub fn in_session(&self) -> bool {
        self.in_session.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Tells the session its facts changed outside its reading of them (a release kept).
    pub fn tell_facts_changed(&self) {
        self.facts_changed.notify_one();
    }

    /// Waits until the facts changed outside a session's reading of them.
    pub async fn facts_changed(&self) {
        self.facts_changed.notified().await
    }
}

/// Content no run record refers to is removed once untouched this long: the grace covers a
/// staged program whose run has not started yet, and a start between its fetch and its record.
pub const CONTENT_GRACE: Duration = Duration::from_secs(600);
/// How often the content is looked over for what to prune.
const PRUNE_EVERY: Duration = Duration::from_secs(60);

impl Node {
    pub fn open(state: &Path, runtime: Arc<dyn Runtime>) -> Result<Node, StateError> {
        let store = Arc::new(Store::open(state)?);
        let scratch = scratch_dir(state);
        let _ = std::fs::remove_dir_all(&scratch);
        Ok(Node {
            store,
            runtime,
            scratch,
            blobs: content_blobs(state),
            content: None,
            artifacts: None,
            fetching: Default::default(),
            pruned_at: Default::default(),
            releases: None,
            run_store: None,
            in_session: Default::default(),
            facts_changed: Default::default(),
        })
    }

    /// The node with its content path to the coordinator, and its artifact root (if any) whose
    /// copies are timed into `meter`.
    pub fn with_content(
        mut self,
        content: ContentLink,
        artifact_root: Option<&Path>,
        meter: Arc<LinkMeter>,
    ) -> Node {
        self.content = Some(content);
        self.artifacts = artifact_root.map(|root| (Blobs::new(root), meter));
        self
    }

    /// What [`FactsSource::collect`](crate::facts::FactsSource::collect) reads of this node on
    /// the blocking pool: its engine and the content on hand.
    pub fn holdings(
        self: &Arc<Self>,
    ) -> impl FnOnce() -> (
        Option<fleet_proto::facts::EngineFacts>,
        fleet_proto::facts::ContentInventory,
    ) + Send
    + 'static {
        let node = self.clone();
        move || (node.runtime.engine(), node.inventory())
    }

    /// The digests on hand: content fetched (the most recently used first), programs staged,
    /// the engine's images.
    pub fn inventory(&self) -> fleet_proto::facts::ContentInventory {
        let held = self.runtime.held();
        let mut fetched = self.blobs.list().unwrap_or_default();
        fetched.sort_by_key(|(_, age)| *age);
        let fetched = fetched.into_iter().map(|(d, _)| d);
        fleet_proto::facts::ContentInventory::of(fetched.chain(held.digests), held.images)
    }

    /// Measures the run store's disk in its checks.
    pub fn with_run_store(mut self, run_store: PathBuf) -> Node {
        self.run_store = Some(run_store);
        self
    }

    /// Takes updates into `releases`.
    pub fn with_releases(mut self, releases: Option<crate::update::Releases>) -> Node {
        self.releases = releases;
        self
    }

    /// Answers one command. Fenced by `generation`; mutating commands are answered from the
    /// applied record when redelivered, and recorded before the answer leaves. The content a
    /// command needs is fetched first, here, and its work then runs on the blocking pool, which
    /// never waits on the network. A run that could not start is logged at warning level with
    /// its reason (a full disk, a missing program), since nobody watches the machine.
    pub async fn execute(self: &Arc<Self>, op: &str, generation: u64, command: &Command) -> Answer {
        let answer = match command {
            Command::Collect {
                run_id,
                path,
                upload,
                max_bytes,
            } => match self.fenced(generation).await {
                Ok(()) => {
                    self.collect(run_id, path, upload, max_bytes.unwrap_or(u64::MAX))
                        .await
                }
                Err(refusal) => Err(refusal),
            },
            Command::Replicate { digest, read } => match self.fenced(generation).await {
                Ok(()) => self.replicate(digest, read.as_ref()).await,
                Err(refusal) => Err(refusal),
            },
            _ => {
                let fetched = self.fetch_ahead(command).await;
                let (node, op, command) = (self.clone(), op.to_string(), command.clone());
                let answered = off_thread(move || {
                    Ok::<_, Unfinished>(node.answer(&op, generation, &command, &fetched))
                });
                (answered.await).unwrap_or_else(|e| Err(Refusal::new(RefusalClass::Other, e)))
            }
        };
        if let (Command::Start(start), Err(refusal)) = (command, &answer) {
            tracing::warn!(op, run_id = %start.run_id, "a run could not start: {}", refusal.message);
        }
        answer
    }

    /// Refuses a command of a session generation older than the newest seen.
    async fn fenced(self: &Arc<Self>, generation: u64) -> Result<(), Refusal> {
        let node = self.clone();
        let checked =
            off_thread(move || Ok::<_, Unfinished>(node.store.check_generation(generation)));
        match checked.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(Refusal::new(RefusalClass::Fenced, e)),
            Err(e) => Err(Refusal::new(RefusalClass::Other, e)),
        }
    }

    /// What `command` will read, fetched now: a stage's program, a start's program and inputs,
    /// a release's binaries once it checked out. Each answer is kept, failures too, for the
    /// command to meet at its own step.
    async fn fetch_ahead(self: &Arc<Self>, command: &Command) -> Fetched {
        let wanted: Vec<Digest> = match command {
            Command::Stage { digest } => vec![*digest],
            Command::Start(start) => {
                let program = match &start.workload {
                    Workload::Program(digest) if !self.blobs.has(digest) => Some(*digest),
                    _ => None,
                };
                let inputs = start.options.inputs.iter().map(|(_, digest)| *digest);
                program.into_iter().chain(inputs).collect()
            }
            Command::Update { release } => match &self.releases {
                Some(releases) => {
                    let (releases, release) = (releases.clone(), release.clone());
                    off_thread(move || Ok::<_, Unfinished>(releases.wanted(&release)))
                        .await
                        .unwrap_or_default()
                }
                None => Vec::new(),
            },
            _ => Vec::new(),
        };
        let mut fetched = Fetched::default();
        for digest in wanted {
            if !fetched.has(&digest) {
                let answer = self.fetch(&digest).await;
                fetched.keep(digest, answer);
            }
        }
        fetched
    }

    fn answer(&self, op: &str, generation: u64, command: &Command, fetched: &Fetched) -> Answer {
        let store_failed = |e: StateError| Refusal::new(RefusalClass::Store, e);
        if let Err(e) = self.store.check_generation(generation) {
            return Err(Refusal::new(RefusalClass::Fenced, e));
        }
        if command.mutates() {
            match self.store.answer_of(op) {
                Ok(Some(recorded)) => return recorded,
                Ok(None) => {}
                Err(e) => return Err(store_failed(e)),
            }
        }
        let answer = match command {
            Command::Stage { digest } => self.stage(digest, fetched),
            Command::Start(start) => self.start(op, start, fetched),
            Command::Stop { run_id } => self
                .runtime
                .stop(run_id)
                .map(|()| Reply::Stopped {
                    run_id: run_id.clone(),
                })
                .map_err(refused),
            Command::Status { run_id } => self
                .runtime
                .status(run_id)
                .map(|s| Reply::Status {
                    run_id: run_id.clone(),
                    state: s.state,
                    report: s.report,
                })
                .map_err(refused),
            Command::Update { release } => match &self.releases {
                Some(releases) => {
                    let taken = releases.take(release, &|digest| fetched.get(digest));
                    // The release's folder holds its own copy: the cache's would only take a
                    // second agent's worth of disk until the prune.
                    if let Err(e) = self.remove_unreferred(fetched.digests()) {
                        tracing::warn!("cannot drop a release's fetched binaries: {e}");
                    }
                    if taken.is_err() {
                        // The refusal is in the facts too, for whoever reads `nodes`.
                        self.facts_changed.notify_one();
                    }
                    taken
                }
                None => Err(Refusal::new(
                    RefusalClass::Release,
                    "this agent runs without an install folder (--install-dir): it cannot update itself",
                )),
            },
            Command::Check(request) => Ok(Reply::Checked {
                rows: crate::check::run(
                    request,
                    self.runtime.as_ref(),
                    &self.blobs,
                    self.run_store.as_deref().unwrap_or(self.blobs.root()),
                ),
                clock_ms: fleet_proto::clock::now_ms(),
            }),
            Command::Facts => Err(Refusal::new(
                RefusalClass::Other,
                "facts are answered by the session",
            )),
            Command::Collect { .. } | Command::Replicate { .. } => Err(Refusal::new(
                RefusalClass::Other,
                "a collect and a replicate are answered beside the blocking work",
            )),
        };
        if command.mutates()
            && let Err(e) = self.store.record_answer(op, &answer)
        {
            return Err(store_failed(e));
        }
        answer
    }

    /// Removes the content no run record refers to any more (its record forgotten once the run
    /// store's retention retired the run, or never made: a stage no run followed), once
    /// untouched for `grace`, and what fetches left unfinished; returns the digests removed.
    pub fn prune_content(&self, grace: Duration) -> Result<Vec<Digest>, StateError> {
        let held = self.blobs.list().unwrap_or_default();
        let old = held.into_iter().filter(|(_, age)| *age >= grace);
        let removed = self.remove_unreferred(old.map(|(digest, _)| digest))?;
        for digest in &removed {
            tracing::info!(%digest, "removed content no run refers to");
        }
        let _ = self.blobs.remove_stale(grace);
        Ok(removed)
    }

    /// Removes each of `digests` that no run record refers to; returns those removed.
    fn remove_unreferred(
        &self,
        digests: impl IntoIterator<Item = Digest>,
    ) -> Result<Vec<Digest>, StateError> {
        let runs = self.store.runs()?;
        let referred: std::collections::HashSet<&Digest> =
            runs.iter().flat_map(|r| r.content()).collect();
        Ok(digests
            .into_iter()
            .filter(|d| !referred.contains(d) && std::fs::remove_file(self.blobs.path(d)).is_ok())
            .collect())
    }

    /// [`Node::prune_content`] with [`CONTENT_GRACE`], at most once a minute.
    pub fn prune_content_when_due(&self) {
        let mut at = self
            .pruned_at
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if at.is_some_and(|t| t.elapsed() < PRUNE_EVERY) {
            return;
        }
        *at = Some(Instant::now());
        if let Err(e) = self.prune_content(CONTENT_GRACE) {
            tracing::warn!("cannot prune the node's content: {e}");
        }
    }

    /// The checked local copy of `digest`, fetched from the coordinator when not held yet.
    async fn fetch(&self, digest: &Digest) -> Result<PathBuf, Refusal> {
        // One fetch per digest at a time: fetches of one digest share its partial file.
        let lock = (self
            .fetching
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner))
        .entry(*digest)
        .or_default()
        .clone();
        let _one = lock.lock().await;
        let held = self.blobs.path(digest);
        if held.is_file() {
            // Used now: the prune's grace starts again.
            let _ = std::fs::File::open(&held)
                .and_then(|f| f.set_modified(std::time::SystemTime::now()));
            return Ok(held);
        }
        let Some(link) = &self.content else {
            return Err(Refusal::new(
                RefusalClass::NotStaged,
                format!(
                    "content {digest}: this node holds no copy and has no content path to a coordinator"
                ),
            ));
        };
        let fetched = link.fetch(digest).await.map_err(content_refused)?;
        // New content on hand: the session sends the inventory again.
        self.facts_changed.notify_one();
        Ok(fetched)
    }

    fn stage(&self, digest: &Digest, fetched: &Fetched) -> Answer {
        let file = fetched.get(digest)?;
        match self.runtime.stage(&file) {
            Ok(got) if got == *digest => Ok(Reply::Staged { digest: got }),
            Ok(got) => Err(Refusal::new(
                RefusalClass::NotStaged,
                format!("stage {digest}: the fetched program hashes to {got}; stage it again"),
            )),
            Err(e) => Err(refused(e)),
        }
    }

    fn start(&self, op: &str, start: &StartRun, fetched: &Fetched) -> Answer {
        let run_id = &start.run_id;
        let store_failed = |e: StateError| Refusal::new(RefusalClass::Store, e);
        // A run id belongs to the first operation that used it; another one is a duplicate.
        match self.store.run_claim(run_id) {
            Ok(Some(claimed)) if claimed != op => {
                return Err(Refusal::new(
                    RefusalClass::RunIdTaken,
                    format!(
                        "run {run_id}: the run id is already used on this node; start it under a new run id"
                    ),
                ));
            }
            Ok(Some(_)) => {}
            Ok(None) => {
                if let Err(e) = self.store.claim_run(run_id, op) {
                    return Err(store_failed(e));
                }
            }
            Err(e) => return Err(store_failed(e)),
        }
        // A program this node did not hold (its stage failed, or never came) was fetched ahead
        // and is staged now, so a run that cannot be delivered fails its own row saying why.
        if let Workload::Program(digest) = &start.workload
            && (fetched.has(digest) || !self.blobs.has(digest))
            && let Err(r) = self.stage(digest, fetched)
        {
            let refusal = Refusal::new(r.class, format!("run {run_id}: {}", r.message));
            return self.fail_run(start, refusal);
        }
        let inputs = match self.fetch_inputs(start, fetched) {
            Ok(i) => i,
            Err(refusal) => return self.fail_run(start, refusal),
        };
        let content: Vec<Digest> = start.options.inputs.iter().map(|(_, d)| *d).collect();
        if let Err(e) = self.store.track_launch(&Launch::of(op, start), &content) {
            return Err(store_failed(e));
        }
        hold_point("run-recorded");
        let spec = RunSpec {
            run_id: run_id.clone(),
            workload: start.workload.clone(),
            argv: start
                .options
                .argv
                .iter()
                .map(|a| OsString::from_vec(a.0.clone()))
                .collect(),
            timeout: start.options.timeout_ms.map(Duration::from_millis),
            grace: None,
            output_limit: start.options.output_limit,
            env: start.options.env.clone(),
            inputs,
            resources: start.options.resources.clone(),
            registry_auth: start.registry_auth.clone(),
        };
        match self.runtime.start(&spec) {
            Ok(started) => {
                if matches!(spec.workload, Workload::Image(_)) {
                    // The engine holds the image now: the session sends the inventory again.
                    self.facts_changed.notify_one();
                }
                Ok(Reply::Started {
                    run_id: run_id.clone(),
                    already: started == Started::Already,
                })
            }
            Err(e) => self.fail_run(start, refused(e)),
        }
    }

    /// The starts recorded `starting` that the runtime does not hold: the agent stopped between
    /// the record and the runtime's claim, and the coordinator, which may have taken the
    /// `starting` event, sends that start no more. Returned to be completed
    /// ([`Node::complete`]); one that cannot be (its registry credential was never recorded, or
    /// an older agent kept no start) ends `failed` here, naming the step that did not happen.
    /// Call it when the agent starts, before its session: no start is in flight then. Blocking.
    pub fn unlaunched(&self) -> Result<Vec<Launch>, StateError> {
        let mut launches = Vec::new();
        for record in self.store.active_runs()? {
            if record.state != RunState::Starting {
                continue;
            }
            match self.runtime.status(&record.run_id) {
                Err(RuntimeError::UnknownRun { .. }) => {}
                // Launched before the crash, or not readable now: the watch takes it from here.
                _ => continue,
            }
            let run_id = record.run_id;
            let unlaunched = "the agent stopped after recording this run and before launching it";
            match record.launch {
                Some(launch) if !launch.had_registry_auth => launches.push(launch),
                Some(launch) => self.fail_unlaunched(
                    Some(&launch.op),
                    &run_id,
                    format!("{unlaunched}, and the registry credential it needs is never recorded on the node; run it again with --registry-auth"),
                )?,
                None => {
                    let op = self.store.run_claim(&run_id)?;
                    self.fail_unlaunched(
                        op.as_deref(),
                        &run_id,
                        format!("{unlaunched}, and its record (written by an older agent) keeps no start to complete; run it again"),
                    )?
                }
            }
        }
        Ok(launches)
    }

    /// Completes a start [`Node::unlaunched`] found: launched under its own operation, whose
    /// answer is recorded, so the runtime's claim by run id keeps it to one launch even when the
    /// coordinator redelivers the start beside it.
    pub async fn complete(self: &Arc<Self>, launch: Launch) -> Result<(), StateError> {
        tracing::info!(run_id = %launch.start.run_id, "completing a start the agent recorded but did not launch");
        let fetched = self
            .fetch_ahead(&Command::Start(launch.start.clone()))
            .await;
        let node = self.clone();
        off_thread(move || {
            let answer = node.start(&launch.op, &launch.start, &fetched);
            node.store.record_answer(&launch.op, &answer)?;
            let run_id = &launch.start.run_id;
            crate::runtime::sync_run(&node.store, node.runtime.as_ref(), run_id).map(drop)
        })
        .await
    }

    /// A start cut off before its launch that cannot be completed: its operation is answered
    /// with `why` (a redelivered start reads that answer, never launching after all), then the
    /// run is recorded `failed` with it.
    fn fail_unlaunched(
        &self,
        op: Option<&str>,
        run_id: &RunId,
        why: String,
    ) -> Result<(), StateError> {
        if let Some(op) = op {
            let answer: Answer = Err(Refusal::new(
                RefusalClass::Other,
                format!("run {run_id}: {why}"),
            ));
            self.store.record_answer(op, &answer)?;
        }
        self.store
            .transition(run_id, RunState::Failed, RunReport::error(why))
            .map(drop)
    }

    /// A start that could not launch: the run is recorded `failed` with the reason, once.
    fn fail_run(&self, start: &StartRun, refusal: Refusal) -> Answer {
        let run_id = &start.run_id;
        let recorded = self.store.track_run(run_id, &start.workload).and_then(|_| {
            self.store.transition(
                run_id,
                RunState::Failed,
                RunReport::error(refusal.message.clone()),
            )
        });
        match recorded {
            Ok(_) => Err(refusal),
            Err(e) => Err(Refusal::new(RefusalClass::Store, e)),
        }
    }

    /// The inputs as (name, the node's checked copy), fetched when not held yet. The runtime
    /// copies each into the run, so a run never changes the node's content.
    fn fetch_inputs(
        &self,
        start: &StartRun,
        fetched: &Fetched,
    ) -> Result<Vec<(String, PathBuf)>, Refusal> {
        let run_id = &start.run_id;
        let mut out = Vec::new();
        for (name, digest) in &start.options.inputs {
            if name.is_empty() || name.contains('/') || name == "." || name == ".." {
                return Err(Refusal::new(
                    RefusalClass::Other,
                    format!("run {run_id}: input name {name:?} must be a plain file name"),
                ));
            }
            let held = fetched.get(digest).map_err(|r| {
                Refusal::new(
                    r.class,
                    format!("run {run_id}: input {name}: {}", r.message),
                )
            })?;
            out.push((name.clone(), held));
        }
        Ok(out)
    }

    /// Replicates an artifact into the artifact root through the read minted for this fetch, and
    /// times the whole copy (the path, the disk and the hash together) into the link meter.
    async fn replicate(&self, digest: &Digest, read: Option<&MintedRead>) -> Answer {
        let taken_up = Instant::now();
        let refuse = |m: &str| Refusal::new(RefusalClass::Other, format!("artifact {digest}: {m}"));
        let Some(read) = read else {
            return Err(refuse(
                "the command carries no minted read (a coordinator ticket or an expiring URL), and this node holds no standing credential to any store; mint a read for this one fetch",
            ));
        };
        let Some((root, meter)) = &self.artifacts else {
            return Err(refuse(
                "this node has no artifact root; start the agent with --artifact-root DIR on the disk artifacts belong on",
            ));
        };
        let held = root.path(digest);
        if let Ok(meta) = std::fs::metadata(&held) {
            return Ok(Reply::Replicated {
                digest: *digest,
                size: meta.len(),
                copy_ms: 0,
                bytes_per_s: None,
            });
        }
        let landed = match read {
            MintedRead::Ticket { ticket } => {
                let Some(link) = &self.content else {
                    return Err(refuse("this node has no content path to a coordinator"));
                };
                link.fetch_into(root, digest, Some(ticket)).await
            }
            MintedRead::Url { url, expires_in_ms } => {
                let deadline = taken_up + Duration::from_millis(*expires_in_ms);
                crate::content::retrying(digest, || {
                    fleet_content::land(root, digest, |offset| {
                        crate::url_read::open(url, digest, offset, deadline)
                    })
                })
                .await
            }
        };
        let path = landed.map_err(content_refused)?;
        let copy = taken_up.elapsed();
        let size = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        let bytes_per_s = (size as u128 * 1000 / copy.as_millis().max(1)) as u64;
        meter.record(bytes_per_s, Instant::now());
        tracing::info!(%digest, size, copy_ms = copy.as_millis() as u64, bytes_per_s, "artifact replicated");
        Ok(Reply::Replicated {
            digest: *digest,
            size,
            copy_ms: copy.as_millis() as u64,
            bytes_per_s: Some(bytes_per_s),
        })
    }

    /// Opens the run's file (bounded by `max_bytes`; the process runtime reads it in place, a
    /// runtime that cannot copies it to scratch first) on the blocking pool, and uploads it,
    /// hashed as it goes.
    async fn collect(
        self: &Arc<Self>,
        run_id: &RunId,
        path: &str,
        upload: &UploadId,
        max_bytes: u64,
    ) -> Answer {
        let opened = off_thread({
            let (node, run_id, path) = (self.clone(), run_id.clone(), path.to_string());
            move || Ok::<_, Unfinished>(node.open_collected(&run_id, &path, max_bytes))
        });
        let collected =
            (opened.await).unwrap_or_else(|e| Err(Refusal::new(RefusalClass::Other, e)))?;
        let Some(link) = &self.content else {
            return Err(Refusal::new(
                RefusalClass::Other,
                format!(
                    "run {run_id}: collect {path}: this node has no content path to a coordinator"
                ),
            ));
        };
        // The run may still write the file: what the node hashed as it sent is what the
        // coordinator checks, and a change between a cut try and the next fails that check.
        let what = format!("{path} of run {run_id}");
        let digest = (link
            .upload(&collected.file, upload, &what, collected.size)
            .await)
            .map_err(content_refused)?;
        let size = collected.size;
        Ok(Reply::Collected { digest, size })
    }

    /// The run's file `path`, bounded by `max_bytes`, opened for its upload (blocking).
    fn open_collected(
        &self,
        run_id: &RunId,
        path: &str,
        max_bytes: u64,
    ) -> Result<crate::runtime::CollectedFile, Refusal> {
        let other = |m: String| Refusal::new(RefusalClass::Other, m);
        std::fs::create_dir_all(&self.scratch)
            .map_err(|e| other(format!("cannot create {}: {e}", self.scratch.display())))?;
        let n = COLLECTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let scratch = self
            .scratch
            .join(format!("collect-{}-{n}", std::process::id()));
        (self.runtime)
            .open_collected(run_id, path, max_bytes, &scratch)
            .map_err(refused)
    }
}

/// Test builds only: `FLEET_AGENT_HOLD_AT=POINT:MARKER` holds the step that reaches `POINT`
/// for good the first time (when it can create `MARKER`), while the session goes on, so a test
/// can SIGKILL the agent exactly there. Release builds have no such hook.
#[cfg(debug_assertions)]
fn hold_point(point: &str) {
    let Ok(wanted) = std::env::var("FLEET_AGENT_HOLD_AT") else {
        return;
    };
    if let Some((at, marker)) = wanted.split_once(':')
        && at == point
        && std::fs::File::create_new(marker).is_ok()
    {
        tracing::warn!(
            point,
            "FLEET_AGENT_HOLD_AT: holding this step until the agent is killed"
        );
        loop {
            std::thread::park();
        }
    }
}

#[cfg(not(debug_assertions))]
fn hold_point(_point: &str) {}

/// An answer as the node records it.
/// A content error as the refusal the coordinator reads.
fn content_refused(e: ContentError) -> Refusal {
    let class = match &e {
        ContentError::NoSpace { .. } => RefusalClass::NoSpace,
        ContentError::Mismatch { .. } => RefusalClass::NotStaged,
        _ => RefusalClass::Other,
    };
    Refusal::new(class, e)
}

/// A runtime error as the refusal the coordinator reads.
fn refused(e: RuntimeError) -> Refusal {
    Refusal::new(e.class(), e)
}
