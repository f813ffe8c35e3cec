//! The run API, mirroring the hub's `fleet.run`, `fleet.run.status` and `fleet.run.collect`: a set
//! has one row per machine; rows wait for their machine, then follow its events to a final state.
use crate::signing::SigningPolicy;
use crate::store::{NodeRecord, RunMoved, RunRow};
use crate::{Coordinator, CoordinatorError};
use fleet_cli::blocking::off_thread;
use fleet_content::Place;
use fleet_proto::clock::now_ms;
use fleet_proto::protocol::{Answer, Command, MintedRead, Reply};
use fleet_proto::run::{ImageRef, Outcome, RegistryAuth, RunOptions, RunState, Workload};
use fleet_proto::{Digest, NodeId, RunId, SetId, UploadId};
use rand::RngCore;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::time::Duration;
use tokio::sync::oneshot;

/// How long a command through a session may take; a collect moves a whole file first.
const CALL_TIMEOUT: Duration = Duration::from_secs(60);
const COLLECT_TIMEOUT: Duration = Duration::from_secs(3600);
/// Rows a `status --set` reads from the store at a time.
const STATUS_PAGE: usize = 1000;

/// What to run, and where.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunRequest {
    /// A node id or name; None with `all`.
    pub node: Option<String>,
    #[serde(default)]
    pub all: bool,
    /// Only nodes that match (with `all`, each of them; else `count` of them, least loaded first).
    #[serde(default, rename = "where", skip_serializing_if = "Option::is_none")]
    pub place: Option<crate::placement::Selector>,
    /// How many matching nodes `place` picks (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count: Option<u32>,
    /// What orders the matching nodes before the least loaded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefer: Option<crate::placement::Preference>,
    /// With `place` (not `all`): when no node matches now, queue for a match rather than refuse.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub wait_for_match: bool,
    /// The program to stage and run, by digest, already in the coordinator's blob store
    /// ([`fleet_content::Blobs::import`]); or else `image`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub program: Option<Digest>,
    /// An image to run, `HOST/REPO@sha256:HEX` (never a tag), on the node's Docker engine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// The credential for pulling `image`. Held only in the serving coordinator's memory until
    /// the node takes the run, and sent only in the start command: never stored, never logged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub registry_auth: Option<RegistryAuth>,
    #[serde(flatten)]
    pub options: RunOptions,
    /// Runs per selected node (default 1).
    #[serde(default = "one")]
    pub repeat: u32,
    /// With `place` (not `all`): a run lost because its machine went away is placed again on
    /// another matching node, up to this many times.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub retry_lost: u32,
    /// For protocol-skew testing, in test builds only: each row's node gets this command object
    /// as-is, in place of the start (under the start's op id, so the node's answer settles it).
    #[cfg(debug_assertions)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub raw_command: Option<serde_json::Value>,
}

fn one() -> u32 {
    1
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl RunRequest {
    /// The content its runs refer to by digest: the program, and the inputs.
    pub fn content(&self) -> Vec<Digest> {
        (self.program.iter())
            .chain(self.options.inputs.iter().map(|(_, d)| d))
            .copied()
            .collect()
    }

    /// The command to send in place of each start: only a test build has one.
    fn raw_command(&self) -> Option<serde_json::Value> {
        #[cfg(debug_assertions)]
        return self.raw_command.clone();
        #[cfg(not(debug_assertions))]
        return None;
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SetView {
    pub set_id: SetId,
    pub program: String,
    pub runs: Vec<RunId>,
}

/// One status row.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunView {
    pub run_id: RunId,
    pub set_id: SetId,
    pub node_id: NodeId,
    pub state: RunState,
    /// How the run ended, whichever runtime ran it.
    pub outcome: Option<Outcome>,
    pub error: Option<String>,
    /// The ids of the events stored for this run.
    pub events: Vec<u64>,
    /// Events stored but not applied, each with why (a state this coordinator cannot read).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub refused_events: Vec<RefusedEvent>,
    /// The runtime's own record of the run, as the node sent it (opaque here).
    pub detail: Option<serde_json::Value>,
    /// When `run` created it, and when it last changed, by the coordinator's clock (Unix ms).
    #[serde(default)]
    pub created_ms: u64,
    #[serde(default)]
    pub updated_ms: u64,
    /// The key whose signature the fleet's signing policy found on the image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signed_by: Option<String>,
    /// Which attempt of its run this row is (1 for the first; `run --retry-lost`).
    #[serde(default = "one")]
    pub attempt: u32,
    /// The lost attempt this one replaces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous: Option<RunId>,
    /// Lost, and placed again as this attempt: whatever this row's node reports later stays
    /// this row's history and never touches the new attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retried_as: Option<RunId>,
    /// Why a waiting row waits, where its node says why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting_for: Option<WaitingFor>,
}

/// Why a run still waits for its node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "reason", rename_all = "snake_case")]
pub enum WaitingFor {
    /// Queued for capacity: the node holds `held` runs not final (this one among them) and takes
    /// `capacity` at once; the queue goes out in order as its runs end.
    Capacity { held: u64, capacity: u32 },
    /// The node lost its lease: the run goes out when it is back, or fails at the waiting timeout.
    NodeAway,
    /// Queued for a match: no node its expression matches was free of its set when it was asked
    /// for; it goes to the first that joins, or fails at the waiting timeout.
    Match,
}

impl std::fmt::Display for WaitingFor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WaitingFor::Capacity { held, capacity } => write!(
                f,
                "queued for capacity: its node holds {held} runs not final and takes {capacity} at once"
            ),
            WaitingFor::NodeAway => {
                f.write_str("its node is away: it goes out when the node is back")
            }
            WaitingFor::Match => {
                f.write_str("queued for a match: it goes to the first node its --where matches")
            }
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RefusedEvent {
    pub id: u64,
    pub reason: String,
}

impl From<RunRow> for RunView {
    fn from(row: RunRow) -> RunView {
        let (outcome, detail) = match row.report {
            Some(report) => (report.outcome, Some(report.detail)),
            None => (None, None),
        };
        RunView {
            events: row.events.iter().map(|e| e.id).collect(),
            refused_events: row
                .events
                .iter()
                .filter_map(|e| {
                    e.refused
                        .clone()
                        .map(|reason| RefusedEvent { id: e.id, reason })
                })
                .collect(),
            run_id: row.id,
            set_id: row.set_id,
            node_id: row.node_id,
            state: row.state,
            outcome,
            error: row.error,
            detail,
            created_ms: row.created_ms,
            updated_ms: row.updated_ms,
            signed_by: row.signed_by,
            attempt: row.attempt,
            previous: row.previous,
            retried_as: row.retried_as,
            waiting_for: None,
        }
    }
}

/// A file collected from a run: checked against `digest` as it landed, it waits at
/// [`fleet_content::Blobs::collected`] for `upload` until the CLI moves it to `--out`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Collected {
    pub digest: Digest,
    pub size: u64,
    pub upload: UploadId,
}

/// A node answered with a reply of another command: a protocol mismatch between versions.
fn unexpected(row: &RunRow, what: &str, reply: &Reply) -> CoordinatorError {
    CoordinatorError::Request(format!(
        "node {} answered {what} with {reply:?}; run an agent of this coordinator's version",
        row.node_id
    ))
}

/// A run id nobody knows, or one that cannot be a run id at all.
fn no_run(run: &str) -> CoordinatorError {
    CoordinatorError::Request(format!("no run {run}: it never existed or was pruned"))
}

/// How long a command may take to be answered: a collect or replicate moves a whole file first.
fn patience(command: &Command) -> Duration {
    match command {
        Command::Collect { .. } | Command::Replicate { .. } => COLLECT_TIMEOUT,
        _ => CALL_TIMEOUT,
    }
}

/// Replicate an artifact onto a node, through a read minted for that one fetch.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReplicateRequest {
    /// A node id or name.
    pub node: String,
    pub digest: Digest,
    /// Mint a one-time ticket for the coordinator's own blob store.
    #[serde(default)]
    pub ticket: bool,
    /// Or an external HTTP URL, usable for `expires_in_ms` from when the node takes it up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_in_ms: Option<u64>,
}

/// An artifact in place on a node.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Replicated {
    pub node_id: NodeId,
    pub digest: Digest,
    pub size: u64,
    pub copy_ms: u64,
    pub bytes_per_s: Option<u64>,
}

impl Coordinator {
    /// Checks an image run against the fleet's signing policy (in the data folder, read afresh);
    /// returns the key that signed it, None when the fleet requires no signature.
    pub async fn check_signature(
        &self,
        request: &RunRequest,
    ) -> Result<Option<String>, CoordinatorError> {
        let Some(image) = &request.image else {
            return Ok(None);
        };
        let data = self.data().to_path_buf();
        let policy = off_thread(move || {
            SigningPolicy::load(&data).map_err(|e| std::io::Error::other(e.to_string()))
        })
        .await
        .map_err(|e| CoordinatorError::Request(e.to_string()))?;
        let Some(policy) = policy else {
            return Ok(None);
        };
        let image = ImageRef::parse(image)?;
        let key = policy.check(&image, request.registry_auth.as_ref()).await?;
        Ok(Some(key))
    }

    /// Records a set with one waiting run per selected node, and wakes their sessions;
    /// `signed_by` is what [`check_signature`](Self::check_signature) found.
    pub fn create_runs(
        &self,
        request: &RunRequest,
        signed_by: Option<String>,
    ) -> Result<SetView, CoordinatorError> {
        let bad = |m: String| CoordinatorError::Request(m);
        let (workload, program) = match (&request.program, &request.image) {
            (Some(digest), None) => (Workload::Program(*digest), Some(digest)),
            (None, Some(image)) => {
                let image = ImageRef::parse(image)?;
                (Workload::Image(image), None)
            }
            _ => {
                return Err(bad(
                    "pass either --program FILE or --image HOST/REPO@sha256:HEX".into(),
                ));
            }
        };
        if request.registry_auth.is_some() {
            if program.is_some() {
                return Err(bad(
                    "--registry-auth goes with --image; a program needs none".into(),
                ));
            }
            self.credentials()
                .can_hold()
                .map_err(|e| bad(e.to_string()))?;
        }
        let named = program
            .map(|d| ("the program".to_string(), d))
            .into_iter()
            .chain(
                (request.options.inputs.iter()).map(|(name, d)| (format!("the input {name}"), d)),
            );
        for (what, digest) in named {
            if !self.blobs().has(digest) {
                return Err(bad(format!(
                    "{what} {digest} is not in the blob store {}; pass the file with --program or --input so it is added",
                    self.blobs().root().display()
                )));
            }
        }
        let retry = match (&request.place, request.all, request.retry_lost) {
            (_, _, 0) => None,
            (_, _, _) if request.registry_auth.is_some() => {
                return Err(bad(
                    "--retry-lost cannot go with --registry-auth: the credential is let go once a node takes the run, so no later attempt could pull the image".into(),
                ));
            }
            (Some(place), false, left) => Some(crate::store::Retry {
                left,
                place: place.clone(),
            }),
            _ => {
                return Err(bad(
                    "--retry-lost places a lost run again on another matching node: use it with --where EXPR (not --node or --all)".into(),
                ));
            }
        };
        let nodes = self.store().nodes()?;
        let selected: Vec<NodeId> = match (&request.node, request.all, &request.place) {
            (None, _, Some(place)) => self.place(&nodes, place, request, &workload)?,
            (Some(_), _, Some(_)) => {
                return Err(bad("pass --node N or --where EXPR, not both".into()));
            }
            // A drained, retired or revoked node takes no new run: `--all` passes it by.
            (_, true, None) => (nodes.iter())
                .filter(|n| n.takes_runs())
                .map(|n| n.id.clone())
                .collect(),
            (Some(wanted), false, None) => {
                let named: Vec<_> = (nodes.iter())
                    .filter(|n| n.id.as_str() == wanted || n.name.as_deref() == Some(wanted))
                    .collect();
                if let Some(ended) = named.iter().find_map(|n| n.ended) {
                    return Err(bad(format!(
                        "the node {wanted} is {} and takes no run: send it to another node",
                        ended.end.as_str()
                    )));
                }
                if let Some(drained) = named.iter().find(|n| n.drained_since_ms.is_some()) {
                    return Err(bad(format!(
                        "the node {wanted} ({}) is draining and takes no new run: send it to another node, or take it back with `fleet-coordinator drain --node {wanted} --undrain`",
                        drained.id
                    )));
                }
                named.iter().map(|n| n.id.clone()).collect()
            }
            (None, false, None) => {
                return Err(CoordinatorError::Request(
                    "pass --node N, --all or --where EXPR".into(),
                ));
            }
        };
        // Every node's record with its facts is let go before the set is built and written.
        let joined = !nodes.is_empty();
        drop(nodes);
        if selected.is_empty() {
            return Err(CoordinatorError::Request(match &request.node {
                Some(wanted) => {
                    format!("no node matches {wanted}: see `fleet-coordinator nodes`")
                }
                None if joined => {
                    "every node is draining: take one back with `fleet-coordinator drain --node N --undrain`".into()
                }
                None => {
                    "no node has joined yet: mint a join file with `fleet-coordinator token`".into()
                }
            }));
        }
        let set_id = crate::ids::new_set_id();
        let now = now_ms();
        let runs: Vec<RunRow> = selected
            .iter()
            .flat_map(|node| std::iter::repeat_n(node.clone(), request.repeat.max(1) as usize))
            .enumerate()
            .map(|(position, node_id)| RunRow {
                id: crate::ids::new_run_id(),
                set_id: set_id.clone(),
                position: u32::try_from(position).unwrap_or(u32::MAX),
                state: RunState::Waiting,
                workload: workload.clone(),
                needs_registry_auth: request.registry_auth.is_some(),
                options: request.options.clone(),
                created_ms: now,
                updated_ms: now,
                accepted: false,
                report: None,
                error: None,
                events: Vec::new(),
                raw_command: request.raw_command(),
                signed_by: signed_by.clone(),
                retry: retry.clone(),
                attempt: 1,
                previous: None,
                retried_as: None,
                queued_for: (node_id == crate::store::unplaced())
                    .then(|| request.place.clone())
                    .flatten(),
                node_id,
            })
            .collect();
        let what = match &workload {
            Workload::Program(digest) => digest.to_string(),
            Workload::Image(image) => image.to_string(),
        };
        if let Some(auth) = &request.registry_auth {
            (self.credentials())
                .hold(runs.iter().map(|r| &r.id), auth)
                .map_err(|e| bad(e.to_string()))?;
        }
        if let Err(e) = self.store().create_set(&set_id, &runs) {
            for run in &runs {
                self.credentials().release(&run.id);
            }
            return Err(e.into());
        }
        self.sessions().wake(&selected);
        Ok(SetView {
            set_id,
            program: what,
            runs: runs.into_iter().map(|r| r.id).collect(),
        })
    }

    /// The nodes `place` picks: joined, not drained, matching; with `all` every one, else
    /// `count` (default 1) of them, ordered by the request's preference, then those holding the
    /// fewest runs first, and [`unplaced`] for each one asked for beyond those that match (queued
    /// for a match). None matching refuses the request, unless it waits for a match.
    ///
    /// [`unplaced`]: crate::store::unplaced
    fn place(
        &self,
        nodes: &[NodeRecord],
        place: &crate::placement::Selector,
        request: &RunRequest,
        workload: &Workload,
    ) -> Result<Vec<NodeId>, CoordinatorError> {
        let out = self.store().runs_out()?;
        let mut matching = crate::placement::candidates(nodes, &out, place, now_ms());
        if matching.is_empty() && (request.all || !request.wait_for_match) {
            let advice = match request.all {
                true => "widen the expression",
                false => "widen the expression, or pass --wait-for-match to queue for one",
            };
            return Err(CoordinatorError::Request(format!(
                "0 of {} nodes match --where {place} (joined and not draining): {advice}",
                nodes.len()
            )));
        }
        if let Some(preference) = request.prefer {
            let mut content = request.content();
            if let Workload::Image(image) = workload {
                content.push(image.digest);
            }
            crate::placement::prefer(&mut matching, preference, place, &content);
        }
        let wanted = match request.all {
            true => matching.len(),
            false => request.count.unwrap_or(1) as usize,
        };
        // Asked for more than match now: the rest wait, queued for a match.
        let queued = wanted.saturating_sub(matching.len());
        Ok((matching.iter().take(wanted))
            .map(|(_, n)| n.id.clone())
            .chain(std::iter::repeat_n(crate::store::unplaced(), queued))
            .collect())
    }

    /// The rows of a set, or the one row of a run. A set's rows are read a page at a time and
    /// kept as views only: the stored rows of a 30 000-run set, with their events and reports,
    /// held at once cost the coordinator a few hundred MiB for each `status --set`.
    pub fn status(
        &self,
        set: Option<&str>,
        run: Option<&str>,
    ) -> Result<Vec<RunView>, CoordinatorError> {
        let mut views: Vec<RunView> = match (set, run) {
            (Some(set), _) => {
                let ids = self.store().set_ids(&SetId::from(set))?.ok_or_else(|| {
                    CoordinatorError::Request(format!(
                        "no set {set}: it never existed or was pruned"
                    ))
                })?;
                let mut views = Vec::with_capacity(ids.len());
                for page in ids.chunks(STATUS_PAGE) {
                    let rows = self.store().runs_in_order(page)?;
                    views.extend(rows.into_iter().map(RunView::from));
                }
                views
            }
            (None, Some(run)) => vec![RunView::from(self.known_run(run)?)],
            (None, None) => {
                return Err(CoordinatorError::Request(
                    "pass --set ID or --run ID".into(),
                ));
            }
        };
        let waits = self.why_waiting(&views)?;
        for view in views.iter_mut().filter(|v| v.state == RunState::Waiting) {
            view.waiting_for = waits.get(&view.node_id).copied();
        }
        Ok(views)
    }

    /// Why the nodes of the waiting rows among `views` keep them waiting, where one can say: one
    /// read of the nodes' leases and capacities and one of the runs out, only when a row waits.
    fn why_waiting(
        &self,
        views: &[RunView],
    ) -> Result<HashMap<NodeId, WaitingFor>, CoordinatorError> {
        let mut why = HashMap::new();
        if views.iter().all(|v| v.state != RunState::Waiting) {
            return Ok(why);
        }
        why.insert(crate::store::unplaced(), WaitingFor::Match);
        let (nodes, out, now) = (
            self.store().node_briefs()?,
            self.store().runs_out()?,
            now_ms(),
        );
        for node in nodes {
            let held = out.get(&node.id).copied().unwrap_or(0);
            let reason = match node.capacity {
                _ if now >= node.lease_until_ms => Some(WaitingFor::NodeAway),
                Some(capacity) if held > u64::from(capacity) => {
                    Some(WaitingFor::Capacity { held, capacity })
                }
                _ => None,
            };
            if let Some(reason) = reason {
                why.insert(node.id, reason);
            }
        }
        Ok(why)
    }

    /// Has the node upload a file from a run's folder into the blob store (refused past
    /// `max_bytes`), through its live session.
    pub async fn collect(
        &self,
        run: &str,
        path: &str,
        max_bytes: Option<u64>,
    ) -> Result<Collected, CoordinatorError> {
        let row = self.stored_run(run).await?;
        let mut raw = [0u8; 16];
        rand::thread_rng().fill_bytes(&mut raw);
        let upload = UploadId::new(hex::encode(raw));
        let place = Place::Collected(upload.clone());
        let expected = self.uploads().expect(&upload, &row.node_id, place.clone());
        let command = Command::Collect {
            run_id: row.id.clone(),
            path: path.to_string(),
            upload: upload.clone(),
            max_bytes,
        };
        let answer = self.call_node(&row.node_id, "collect", command).await;
        drop(expected);
        match answer? {
            Reply::Collected { digest, size } => {
                // Uploaded here, or (relayed) at the coordinator holding the session, which
                // keeps it as a blob: copied here by digest, checked, and put in place.
                let here = self.blobs().collected(&upload);
                let landed = match here.is_file() {
                    true => Ok(()),
                    false => match self.ensure_blob(&digest).await {
                        Ok(()) => {
                            let blobs = self.blobs().clone();
                            off_thread(move || blobs.place(&blobs.path(&digest), &digest, &place))
                                .await
                                .map(|_| ())
                                .map_err(|e| e.to_string())
                        }
                        Err(e) => Err(e.to_string()),
                    },
                };
                match landed {
                    Ok(()) => Ok(Collected {
                        digest,
                        size,
                        upload,
                    }),
                    Err(why) => Err(CoordinatorError::Request(format!(
                        "node {} reported {path} uploaded as {digest}, but the coordinator holds no such upload ({why}); collect it again",
                        row.node_id
                    ))),
                }
            }
            other => Err(unexpected(&row, "collect", &other)),
        }
    }

    /// Replicates an artifact onto a node through its live session, with the read the request
    /// asks for (none is sent as none: the node refuses it in its own words); then asks the node
    /// for fresh facts, which carry its measured link.
    pub async fn replicate(
        &self,
        request: &ReplicateRequest,
    ) -> Result<Replicated, CoordinatorError> {
        let bad = |m: String| CoordinatorError::Request(m);
        let node_id = (self.with_store(|store| store.nodes()).await?)
            .into_iter()
            .find(|n| n.id.as_str() == request.node || n.name.as_deref() == Some(&request.node))
            .map(|n| n.id)
            .ok_or_else(|| {
                bad(format!(
                    "no node matches {}: see `fleet-coordinator nodes`",
                    request.node
                ))
            })?;
        let digest = &request.digest;
        let read = match (request.ticket, &request.url) {
            (true, Some(_)) => {
                return Err(bad(
                    "pass either --file (a ticket) or --url, not both".into()
                ));
            }
            (true, None) => {
                if !self.blobs().has(digest) {
                    return Err(bad(format!(
                        "the blob store {} holds no {digest}; pass the artifact with --file",
                        self.blobs().root().display()
                    )));
                }
                let ticket = self.tickets().mint(&node_id, digest);
                Some(MintedRead::Ticket { ticket })
            }
            (false, Some(url)) => Some(MintedRead::Url {
                url: url.clone(),
                expires_in_ms: request.expires_in_ms.ok_or_else(|| {
                    bad(
                        "--url needs --expires-in: a read is minted for a while, never for ever"
                            .into(),
                    )
                })?,
            }),
            (false, None) => None,
        };
        let command = Command::Replicate {
            digest: *digest,
            read,
        };
        match self.call_node(&node_id, "replicate", command).await? {
            Reply::Replicated {
                digest,
                size,
                copy_ms,
                bytes_per_s,
            } => {
                if let Err(e) = self.call_node(&node_id, "facts", Command::Facts).await {
                    tracing::warn!(%node_id, "could not refresh the facts after a replicate: {e}");
                }
                Ok(Replicated {
                    node_id,
                    digest,
                    size,
                    copy_ms,
                    bytes_per_s,
                })
            }
            other => Err(CoordinatorError::Request(format!(
                "node {node_id} answered replicate with {other:?}; run an agent of this coordinator's version"
            ))),
        }
    }

    /// Stops a run through its node's live session. The node answers once the run ended; the
    /// row follows with the run's final event, its record saying it was stopped.
    pub async fn stop(&self, run: &str) -> Result<(), CoordinatorError> {
        let row = self.stored_run(run).await?;
        if row.state.is_final() {
            return Err(CoordinatorError::Request(format!(
                "run {run} already ended ({}): there is nothing to stop",
                row.state
            )));
        }
        if !row.accepted {
            return Err(CoordinatorError::Request(format!(
                "run {run} has not reached node {} yet: stop it once `status` shows it starting or running",
                row.node_id
            )));
        }
        let command = Command::Stop {
            run_id: row.id.clone(),
        };
        match self.call_node(&row.node_id, "stop", command).await? {
            Reply::Stopped { .. } => Ok(()),
            other => Err(unexpected(&row, "stop", &other)),
        }
    }

    /// [`Self::known_run`] from async code: off the async thread, as every store call there.
    async fn stored_run(&self, run: &str) -> Result<RunRow, CoordinatorError> {
        let id = RunId::parse(run).map_err(|_| no_run(run))?;
        let row = self.with_store(move |store| store.run(&id)).await?;
        row.ok_or_else(|| no_run(run))
    }

    fn known_run(&self, run: &str) -> Result<RunRow, CoordinatorError> {
        let id = RunId::parse(run).map_err(|_| no_run(run))?;
        self.store().run(&id)?.ok_or_else(|| no_run(run))
    }

    /// Sends `command` to the node over its live session, here or through the coordinator of
    /// the fleet that holds it (`what` names the operator command for the error when there is
    /// none), and returns the node's reply.
    pub(crate) async fn call_node(
        &self,
        node_id: &NodeId,
        what: &str,
        command: Command,
    ) -> Result<Reply, CoordinatorError> {
        let no_session = || {
            CoordinatorError::Request(format!(
                "node {node_id} has no session now: {what} needs it connected to a serving coordinator"
            ))
        };
        let answer = match self.sessions().calls(node_id) {
            Some(_) => self.call_held(node_id, command).await?,
            None => {
                let id = node_id.clone();
                let node = self.with_store(move |store| store.node(&id)).await?;
                let holder = node.and_then(|n| n.session_at);
                let holder = holder.filter(|at| Some(at.as_str()) != self.fleet().address());
                let Some(holder) = holder else {
                    return Err(no_session());
                };
                let patience = patience(&command);
                crate::peer::relay(self, &holder, node_id, command, patience).await?
            }
        };
        answer.map_err(CoordinatorError::Refused)
    }

    /// Sends `command` to the node over the session this coordinator holds, and returns the
    /// node's answer; for a peer's relay too.
    pub async fn call_held(
        &self,
        node_id: &NodeId,
        command: Command,
    ) -> Result<Answer, CoordinatorError> {
        let gone =
            || CoordinatorError::Request(format!("node {node_id} went away before answering"));
        let link = self.sessions().calls(node_id).ok_or_else(|| {
            CoordinatorError::Request(format!(
                "node {node_id} has no session at this coordinator now; try again once it reconnects"
            ))
        })?;
        let patience = patience(&command);
        let (reply, answer) = oneshot::channel();
        link.send(Box::new((command, reply)))
            .await
            .map_err(|_| gone())?;
        tokio::time::timeout(patience, answer)
            .await
            .map_err(|_| gone())?
            .map_err(|_| gone())
    }

    /// Final-state sweep over `nodes` and the runs out (`active`), as just read: runs nobody took
    /// within `waiting_timeout` fail; runs whose node lost its lease (while this coordinator has
    /// been up long enough to know) are `lost`.
    /// Wakes the sessions held here whose node has runs waiting: one read of the waiting index,
    /// whatever the fleet's size.
    pub(crate) fn wake_waiting_sessions(&self) {
        match self.store().waiting_nodes() {
            Ok(nodes) => self.sessions().wake(&nodes),
            Err(e) => tracing::warn!("reading the waiting runs failed: {e}"),
        }
    }

    pub(crate) fn sweep(
        &self,
        leases: &[(NodeId, u64)],
        active: Vec<crate::store::ActiveRun>,
        waiting_timeout_ms: u64,
        up_since_ms: u64,
        lease_ms: u64,
        read_at_ms: u64,
    ) -> Result<(), CoordinatorError> {
        // Judged at the time of the read: a lease renewed while a slow read went on is not seen
        // in `leases`, and the clock of now would find it passed.
        let now = read_at_ms;
        let nodes: HashMap<&NodeId, u64> = leases.iter().map(|(id, until)| (id, *until)).collect();
        let mut retried = false;
        for row in active {
            let lease_until = nodes.get(&row.node_id).copied().unwrap_or(0);
            // A node whose session this coordinator holds was heard, whatever the store says yet
            // (its heartbeats may wait for a database that is back only now).
            let held_here = self.sessions().holds(&row.node_id);
            let verdict = if row.state == RunState::Waiting {
                (now > row.created_ms + waiting_timeout_ms).then(|| {
                    let why = match &row.queued_for {
                        Some(place) if row.node_id == crate::store::unplaced() => {
                            format!("no other node matched --where {place}")
                        }
                        _ => format!("node {} did not take the run", row.node_id),
                    };
                    // Why it was not sent, when the session said (content with no holder).
                    let last = row
                        .error
                        .as_ref()
                        .map_or(String::new(), |e| format!(": {e}"));
                    (
                        RunState::Failed,
                        format!("{why} within {} s{last}", waiting_timeout_ms / 1000),
                    )
                })
            } else {
                (!held_here && now > lease_until && now > up_since_ms + lease_ms).then(|| {
                    (
                        RunState::Lost,
                        format!(
                            "node {} stopped answering while the run was {}",
                            row.node_id, row.state
                        ),
                    )
                })
            };
            if let Some((state, reason)) = verdict {
                let after = match state {
                    RunState::Lost => self.store().lose_run(&row.id, &reason, now)?,
                    _ => self.store().fail_run(&row.id, state, &reason)?,
                };
                if let Some(next) = after.as_ref().and_then(|r| r.retried_as.as_ref()) {
                    tracing::info!(run_id = %row.id, %next, "a lost run is placed again");
                    retried = true;
                }
                if let Some(ended) = after.filter(|r| r.state == state && r.error == Some(reason)) {
                    tracing::info!(run_id = %row.id, node_id = %row.node_id, %state, lease_until, judged_at = now, "a run ended by the sweep");
                    self.recorder().runs_moved(&[RunMoved {
                        state,
                        outcome: None,
                        created_ms: ended.created_ms,
                        at_ms: ended.updated_ms,
                    }]);
                }
                self.credentials().release(&row.id);
            }
        }
        // Runs queued for a match go to the nodes that match now.
        let placed = self.store().place_queued(now)?;
        if !placed.is_empty() {
            tracing::info!(runs = placed.len(), "runs queued for a match were placed");
        }
        if retried || !placed.is_empty() {
            self.wake_waiting_sessions();
        }
        Ok(())
    }
}
