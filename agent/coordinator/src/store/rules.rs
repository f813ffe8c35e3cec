//! The intents the coordinator stores, and the rules they follow, written once over any
//! [`Backend`].
use super::{
    ActiveRun, Backend, Beat, BootstrapFailure, DispatchView, Ending, EventRecord, FleetEntry,
    Layout, NodeBrief, NodeEvent, NodeProtocol, NodeRecord, ReadTx, Redeemed, ReleaseRecord, Retry,
    RunRow, SCHEMA_VERSION, Store, StoreError, StoreResult, TokenRecord, WriteTx,
};
use fleet_proto::clock::now_ms;
use fleet_proto::facts::Facts;
use fleet_proto::pin::PinnedKey;
use fleet_proto::protocol::NodeEnd;
use fleet_proto::release::ReleaseTrust;
use fleet_proto::run::{Outcome, RunState};
use fleet_proto::version::{Incompatible, ProtocolVersion};
use fleet_proto::{Digest, NodeId, RunId, SetId};
use std::collections::BTreeMap;

impl Store {
    /// Opens the store over `backend`: a blank one is created at [`SCHEMA_VERSION`], an older
    /// one upgraded to it; a newer one, or one that records no version, is refused with
    /// [`StoreError::Schema`] and left as it is. The newest `keep_final_runs` final runs of each
    /// node are kept (at least one).
    pub fn open(backend: Box<dyn Backend>, keep_final_runs: u64) -> StoreResult<Store> {
        let found = match backend.layout()? {
            Layout::Blank => {
                backend.create(SCHEMA_VERSION)?;
                backend.layout()?
            }
            Layout::Version(older) if (1..SCHEMA_VERSION).contains(&older) => {
                backend.upgrade(older, SCHEMA_VERSION)?;
                backend.layout()?
            }
            found => found,
        };
        let schema = |found| StoreError::Schema {
            store: backend.location(),
            found,
            expected: SCHEMA_VERSION,
        };
        match found {
            Layout::Version(SCHEMA_VERSION) => {}
            Layout::Version(other) => return Err(schema(Some(other))),
            Layout::Unversioned => return Err(schema(None)),
            Layout::Blank => {
                return Err(StoreError::Db(format!(
                    "{} is still blank after it was created",
                    backend.location()
                )));
            }
        }
        Ok(Store {
            backend,
            keep_final_runs: keep_final_runs.max(1),
        })
    }

    /// How many final runs of each node the retention keeps.
    pub fn keep_final_runs(&self) -> u64 {
        self.keep_final_runs
    }

    /// Which database holds the store (`redb`, `postgres`).
    pub fn kind(&self) -> &'static str {
        self.backend.kind()
    }

    pub fn parallel_calls(&self) -> usize {
        self.backend.parallel_calls()
    }

    /// See [`Backend::refresh_statistics`].
    pub fn refresh_statistics(&self) -> StoreResult<Vec<String>> {
        self.backend.refresh_statistics()
    }

    /// The store's file or database, for messages.
    pub fn location(&self) -> String {
        self.backend.location()
    }

    /// A setting of the database that will slow a large fleet, for `serve` to log.
    pub fn tuning_advice(&self) -> StoreResult<Option<String>> {
        self.backend.tuning_advice()
    }

    /// A read-only look at the records, on one snapshot (for reports and tests).
    pub fn read<T>(&self, mut f: impl FnMut(&dyn ReadTx) -> StoreResult<T>) -> StoreResult<T> {
        let mut out = None;
        self.backend.read(&mut |tx| {
            out = Some(f(tx)?);
            Ok(())
        })?;
        out.ok_or_else(|| StoreError::Db("the backend skipped a read".into()))
    }

    /// One transaction; `f` may run again if the backend retries it.
    fn write<T>(&self, f: impl FnMut(&mut dyn WriteTx) -> StoreResult<T>) -> StoreResult<T> {
        self.write_with(|backend, tx| backend.write(tx), f)
    }

    /// Runs `f` in the transaction `how` opens on the backend, answering what `f` answered.
    fn write_with<T>(
        &self,
        how: impl FnOnce(
            &dyn Backend,
            &mut dyn FnMut(&mut dyn WriteTx) -> StoreResult<()>,
        ) -> StoreResult<()>,
        mut f: impl FnMut(&mut dyn WriteTx) -> StoreResult<T>,
    ) -> StoreResult<T> {
        let mut out = None;
        how(self.backend.as_ref(), &mut |tx| {
            out = Some(f(tx)?);
            Ok(())
        })?;
        out.ok_or_else(|| StoreError::Db("the backend skipped a transaction".into()))
    }

    /// Records a freshly minted token, and drops every token whose expiry passed by `now_ms`
    /// (the coordinator's clock). A spent token stays until it expires: its join is answered
    /// again for the same key until then.
    pub fn add_token(&self, hash: &str, token: &TokenRecord, now_ms: u64) -> StoreResult<()> {
        self.add_tokens(&[(hash.to_string(), token.clone())], now_ms)
    }

    /// [`Store::add_token`] for many tokens (hash, record) in one transaction, pruning once.
    pub fn add_tokens(&self, tokens: &[(String, TokenRecord)], now_ms: u64) -> StoreResult<()> {
        self.write(|tx| {
            for (old, record) in tx.tokens()? {
                if now_ms >= record.expires_at_ms {
                    tx.remove_token(&old)?;
                }
            }
            for (hash, token) in tokens {
                tx.put_token(hash, token)?;
            }
            Ok(())
        })
    }

    /// Spends the token for `key` and records the node; answers again for the same key until the
    /// token expires; None for an unknown, expired, or foreign-spent token.
    pub fn redeem(
        &self,
        hash: &str,
        key: &str,
        node_id: &NodeId,
        now_ms: u64,
        lease_until_ms: u64,
    ) -> StoreResult<Option<Redeemed>> {
        // A wrong token costs a read, never a write: a flood of them commits nothing.
        let usable = self.read(|tx| {
            Ok(tx.token(hash)?.is_some_and(|token| {
                now_ms < token.expires_at_ms
                    && token.bootstrap_failure.is_none()
                    && token.spent_by.as_deref().is_none_or(|s| s == key)
            }))
        })?;
        if !usable {
            return Ok(None);
        }
        self.write(|tx| {
            let Some(mut token) = tx.token(hash)? else {
                return Ok(None);
            };
            if now_ms >= token.expires_at_ms || token.bootstrap_failure.is_some() {
                return Ok(None);
            }
            match token.spent_by.as_deref() {
                Some(spender) if spender != key => Ok(None),
                Some(_) => Ok(tx
                    .node(node_id)?
                    .map(|node| Redeemed { node, first: false })),
                None => {
                    token.spent_by = Some(key.to_string());
                    tx.put_token(hash, &token)?;
                    let node = NodeRecord {
                        id: node_id.clone(),
                        public_key: key.to_string(),
                        name: token.name.clone(),
                        labels: token.labels.clone(),
                        facts: None,
                        joined_at_ms: now_ms,
                        last_heartbeat_ms: None,
                        lease_until_ms,
                        generation: 0,
                        last_event_id: 0,
                        session_at: None,
                        drained_since_ms: None,
                        capacity: None,
                        ended: None,
                        idle_since_ms: None,
                        protocol: None,
                    };
                    tx.put_node(&node)?;
                    tx.put_lease(node_id, None, lease_until_ms)?;
                    Ok(Some(Redeemed { node, first: true }))
                }
            }
        })
    }

    /// Whether some machine may still be waiting to join (an unexpired, unspent token whose
    /// bootstrap did not fail exists).
    pub fn has_waiting_token(&self, now_ms: u64) -> StoreResult<bool> {
        self.read(|tx| Ok(tx.tokens()?.iter().any(|(_, t)| waiting(t, now_ms))))
    }

    /// Records that the machine handed this token could not bootstrap, and why; the token is
    /// burnt (never redeemed). Only a token still waiting takes a report, once: false for an
    /// unknown, expired, spent or already failed token.
    pub fn fail_bootstrap(&self, hash: &str, reason: &str, now_ms: u64) -> StoreResult<bool> {
        self.write(|tx| {
            let Some(mut token) = tx.token(hash)? else {
                return Ok(false);
            };
            if !waiting(&token, now_ms) {
                return Ok(false);
            }
            token.bootstrap_failure = Some(BootstrapFailure {
                at_ms: now_ms,
                reason: reason.to_string(),
            });
            tx.put_token(hash, &token)?;
            Ok(true)
        })
    }

    /// Every token whose bootstrap failed, with its hash; each stays until it expires.
    pub fn failed_bootstraps(&self) -> StoreResult<Vec<(String, TokenRecord)>> {
        self.read(|tx| {
            Ok(tx
                .tokens()?
                .into_iter()
                .filter(|(_, t)| t.bootstrap_failure.is_some())
                .collect())
        })
    }

    pub fn node(&self, id: &NodeId) -> StoreResult<Option<NodeRecord>> {
        self.read(|tx| tx.node(id))
    }

    pub fn nodes(&self) -> StoreResult<Vec<NodeRecord>> {
        self.read(|tx| tx.nodes())
    }

    /// Every node's lease end (see [`ReadTx::lease_ends`]).
    pub fn lease_ends(&self) -> StoreResult<Vec<(NodeId, u64)>> {
        self.read(|tx| tx.lease_ends())
    }

    /// Drains the node from `since_ms` (it takes no new run; a node already draining keeps its
    /// first time), or with None takes it back; None for an unknown node.
    pub fn set_drain(&self, id: &NodeId, since_ms: Option<u64>) -> StoreResult<Option<NodeRecord>> {
        self.write(|tx| {
            let Some(mut node) = tx.node(id)? else {
                return Ok(None);
            };
            node.drained_since_ms = since_ms.map(|t| node.drained_since_ms.unwrap_or(t));
            tx.put_node(&node)?;
            tx.count_node_change()?;
            Ok(Some(node))
        })
    }

    /// Sets the operator's limit on the node's runs at once (None lifts it); None for an
    /// unknown node.
    pub fn set_capacity(
        &self,
        id: &NodeId,
        capacity: Option<u32>,
    ) -> StoreResult<Option<NodeRecord>> {
        self.write(|tx| {
            let Some(mut node) = tx.node(id)? else {
                return Ok(None);
            };
            node.capacity = capacity;
            tx.put_node(&node)?;
            tx.count_node_change()?;
            Ok(Some(node))
        })
    }

    /// Ends the node (retired or revoked) at `now_ms`: its key is refused from then on, and the
    /// runs it holds end `lost` with the end as their reason. Retiring a node that holds runs is
    /// refused unless `discard`; a node ended one way is not ended the other.
    pub fn end_node(
        &self,
        id: &NodeId,
        end: NodeEnd,
        discard: bool,
        now_ms: u64,
    ) -> StoreResult<EndOutcome> {
        let keep = self.keep_final_runs;
        self.write(|tx| {
            let Some(mut node) = tx.node(id)? else {
                return Ok(EndOutcome::Unknown);
            };
            match node.ended {
                Some(e) if e.end == end => {
                    let node = Box::new(node);
                    return Ok(EndOutcome::Ended { node, lost: 0 });
                }
                Some(e) => return Ok(EndOutcome::AlreadyEnded(e.end)),
                None => {}
            }
            let out = tx.active(Some(id))?;
            if end == NodeEnd::Retired && !discard && !out.is_empty() {
                return Ok(EndOutcome::HoldsRuns(out.len() as u64));
            }
            let lost = lose_runs(tx, keep, &out, end.as_str())?;
            node.ended = Some(Ending { end, at_ms: now_ms });
            tx.put_node(&node)?;
            tx.count_node_change()?;
            let node = Box::new(node);
            Ok(EndOutcome::Ended { node, lost })
        })
    }

    /// Removes the record of a node that is ended or has lost its lease (its runs stay as
    /// history; any still out end `lost`, reason `forgotten`).
    pub fn forget_node(&self, id: &NodeId, now_ms: u64) -> StoreResult<ForgetOutcome> {
        let keep = self.keep_final_runs;
        self.write(|tx| {
            let Some(node) = tx.node(id)? else {
                return Ok(ForgetOutcome::Unknown);
            };
            if node.ended.is_none() && now_ms < node.lease_until_ms {
                return Ok(ForgetOutcome::Live);
            }
            let out = tx.active(Some(id))?;
            lose_runs(tx, keep, &out, "forgotten")?;
            tx.remove_node(id)?;
            tx.count_node_change()?;
            Ok(ForgetOutcome::Forgotten(Box::new(node)))
        })
    }

    /// Places the runs queued for a match, oldest first, each on a node its expression now
    /// matches that holds no row of its set (least loaded first): out of [`unplaced`]'s indexes
    /// into the node's, in one transaction. Returns the nodes that got one.
    pub fn place_queued(&self, now_ms: u64) -> StoreResult<Vec<NodeId>> {
        // Read first: the sweep asks every heartbeat, and the queue is nearly always empty.
        if self.read(|tx| tx.waiting(&super::unplaced()))?.is_empty() {
            return Ok(Vec::new());
        }
        self.write(|tx| {
            let queue = super::unplaced();
            let mut rows = runs_of(tx, &tx.waiting(&queue)?)?;
            rows.retain(|r| r.node_id == queue && is_waiting(r));
            if rows.is_empty() {
                return Ok(Vec::new());
            }
            rows.sort_by(waiting_order);
            let (nodes, mut out) = (tx.nodes()?, tx.active_counts()?);
            let mut holding: BTreeMap<SetId, Vec<NodeId>> = BTreeMap::new();
            let mut placed = Vec::new();
            for mut row in rows {
                let Some(place) = row.queued_for.clone() else {
                    continue;
                };
                if !holding.contains_key(&row.set_id) {
                    let ids = tx.set(&row.set_id)?.unwrap_or_default();
                    let held = runs_of(tx, &ids)?.into_iter().map(|r| r.node_id).collect();
                    holding.insert(row.set_id.clone(), held);
                }
                let taken = &holding[&row.set_id];
                let Some(node) = (crate::placement::candidates(&nodes, &out, &place, now_ms))
                    .into_iter()
                    .map(|(_, n)| n.id.clone())
                    .find(|n| !taken.contains(n))
                else {
                    continue;
                };
                tx.remove_waiting(&row.id, &queue)?;
                tx.remove_active(&row.id, &queue)?;
                row.node_id = node.clone();
                row.updated_ms = now_ms;
                tx.put_run(&row)?;
                tx.put_active(&row.id, &node)?;
                tx.put_waiting(&row.id, &node)?;
                *out.entry(node.clone()).or_default() += 1;
                if let Some(held) = holding.get_mut(&row.set_id) {
                    held.push(node.clone());
                }
                placed.push(node);
            }
            Ok(placed)
        })
    }

    /// Notes on a waiting run why it is not sent yet (its content has no reachable holder), as
    /// its `error` until it is taken or fails; a run no longer waiting, or already saying so,
    /// is left as it is.
    pub fn note_waiting(&self, id: &RunId, reason: &str) -> StoreResult<()> {
        let keep = self.keep_final_runs;
        self.write(|tx| {
            change_run(tx, keep, id, &mut |r| {
                let notes = is_waiting(r) && r.error.as_deref() != Some(reason);
                if notes {
                    r.error = Some(reason.to_string());
                }
                notes
            })
            .map(drop)
        })
    }

    /// The fleet's public key: the one recorded, or `key` when none was (this coordinator is the
    /// store's first); the caller compares it with its own.
    pub fn claim_fleet_key(&self, key: &str) -> StoreResult<String> {
        self.write(|tx| match tx.fleet_entry(FleetEntry::PublicKey)? {
            Some(fleet) => Ok(fleet),
            None => (tx.set_fleet_entry(FleetEntry::PublicKey, key)).map(|()| key.to_string()),
        })
    }

    /// The content stored runs refer to (programs, inputs) and the binaries of the releases
    /// taken in, each digest once.
    pub fn referenced_content(&self) -> StoreResult<Vec<fleet_proto::Digest>> {
        let (digests, releases) =
            self.read(|tx| Ok((tx.referenced_content()?, releases_in(tx)?)))?;
        let mut all: Vec<fleet_proto::Digest> = digests;
        let binaries = releases.iter().flat_map(|r| &r.manifest_read.binaries);
        all.extend(binaries.map(|b| b.sha256));
        all.sort();
        all.dedup();
        Ok(all)
    }

    /// The root keys a release must be certified by.
    pub fn release_roots(&self) -> StoreResult<Vec<PinnedKey>> {
        self.read(|tx| release_roots_in(tx))
    }

    /// The roots a release must be certified by and the release keys revoked.
    pub fn release_trust(&self) -> StoreResult<ReleaseTrust> {
        self.read(|tx| release_trust_in(tx))
    }

    /// Revokes the release key `key` (once): no release it signed is taken in or sent from now on.
    pub fn revoke_release_key(&self, key: &PinnedKey) -> StoreResult<ReleaseTrust> {
        self.write(|tx| {
            let mut trust = release_trust_in(tx)?;
            if !trust.revoked.contains(key) {
                trust.revoked.push(key.clone());
                tx.set_fleet_entry(FleetEntry::RevokedReleaseKeys, &text_of(&trust.revoked))?;
            }
            Ok(trust)
        })
    }

    /// The release of `sequence` (the newest taken in when None) as the fleet may still send it:
    /// checked again under today's trust at `now_ms`, so a revoked key, a root rotated away or
    /// an expiry stops it here with the reason.
    pub fn sendable_release(
        &self,
        sequence: Option<u64>,
        now_ms: u64,
    ) -> StoreResult<ReleaseRecord> {
        self.read(|tx| {
            let releases = releases_in(tx)?;
            let found = match sequence {
                Some(s) => releases.into_iter().find(|r| r.manifest_read.sequence == s),
                None => releases.into_iter().max_by_key(|r| r.manifest_read.sequence),
            };
            let release = found.ok_or_else(|| StoreError::Refused(match sequence {
                Some(s) => format!(
                    "no release of sequence {s} was taken in: see `fleet-coordinator release list`"
                ),
                None => "no release was taken in: run `fleet-coordinator release add DIR` first".into(),
            }))?;
            let trust = release_trust_in(tx)?;
            if let Err(refusal) = release.offer().verify(&trust, now_ms) {
                return Err(StoreError::Refused(format!(
                    "release {} can no longer be sent: {refusal}",
                    release.manifest_read.sequence
                )));
            }
            Ok(release)
        })
    }

    /// Adds `root` to the keys a release may be certified by (once); answers them all.
    pub fn trust_release_root(&self, root: &PinnedKey) -> StoreResult<Vec<PinnedKey>> {
        self.write(|tx| {
            let mut roots = release_roots_in(tx)?;
            if !roots.contains(root) {
                roots.push(root.clone());
                tx.set_fleet_entry(FleetEntry::ReleaseRoots, &text_of(&roots))?;
            }
            Ok(roots)
        })
    }

    /// One entry of the fleet's table, read as JSON; None when it was never written.
    pub fn fleet_value<T: serde::de::DeserializeOwned>(
        &self,
        entry: FleetEntry,
    ) -> StoreResult<Option<T>> {
        self.read(|tx| fleet_json::<Option<T>>(tx, entry))
    }

    /// Changes one entry of the fleet's table in one transaction: `change` gets what is there and
    /// answers what to write (None: leave it) and what to answer. It may run more than once (a
    /// transaction tried again), so it must only compute.
    pub fn change_fleet_value<T, R>(
        &self,
        entry: FleetEntry,
        mut change: impl FnMut(Option<T>) -> StoreResult<(Option<T>, R)>,
    ) -> StoreResult<R>
    where
        T: serde::de::DeserializeOwned + serde::Serialize,
    {
        self.write(|tx| {
            let (write, answer) = change(fleet_json::<Option<T>>(tx, entry)?)?;
            if let Some(value) = write {
                tx.set_fleet_entry(entry, &text_of(&value))?;
            }
            Ok(answer)
        })
    }

    /// The releases taken in, oldest first.
    pub fn releases(&self) -> StoreResult<Vec<ReleaseRecord>> {
        self.read(|tx| releases_in(tx))
    }

    /// Takes in a checked release, whose sequence must be above every release's before it; the
    /// same release again changes nothing.
    pub fn add_release(&self, release: &ReleaseRecord) -> StoreResult<ReleaseAdded> {
        self.write(|tx| {
            let mut releases = releases_in(tx)?;
            let sequence = release.manifest_read.sequence;
            if let Some(same) = releases.iter().find(|r| r.manifest == release.manifest) {
                return Ok(ReleaseAdded::Already(Box::new(same.clone())));
            }
            if let Some(newest) = releases.iter().map(|r| &r.manifest_read).max_by_key(|m| m.sequence)
                && newest.sequence >= sequence
            {
                return Err(StoreError::Refused(format!(
                    "the release's sequence {sequence} is not above {}, the sequence of release {} taken in before: sign it with a higher --sequence",
                    newest.sequence, newest.version
                )));
            }
            releases.push(release.clone());
            tx.set_fleet_entry(FleetEntry::Releases, &text_of(&releases))?;
            // A release that rotates the roots or revokes keys changes what the fleet trusts.
            let trust = release_trust_in(tx)?;
            let after = trust.after(&release.manifest_read);
            if after.roots != trust.roots {
                tx.set_fleet_entry(FleetEntry::ReleaseRoots, &text_of(&after.roots))?;
            }
            if after.revoked != trust.revoked {
                tx.set_fleet_entry(FleetEntry::RevokedReleaseKeys, &text_of(&after.revoked))?;
            }
            Ok(ReleaseAdded::New)
        })
    }

    /// Changes every time the operator ends a node or sets its capacity; see [`ReadTx::node_changes`].
    pub fn node_changes(&self) -> StoreResult<u64> {
        self.read(|tx| tx.node_changes())
    }

    /// What a session needs to send a node its runs: the runs waiting for it (oldest first), how
    /// many of its runs are out in all (waiting or taken, not final), and its record.
    pub fn dispatch_view(
        &self,
        node_id: &NodeId,
    ) -> StoreResult<(Vec<RunRow>, u64, Option<NodeRecord>)> {
        let DispatchView {
            waiting: mut runs,
            out,
            node,
        } = self.backend.dispatch_view(node_id)?;
        runs.retain(|r| &r.node_id == node_id && is_waiting(r));
        runs.sort_by(waiting_order);
        Ok((runs, out, node))
    }

    /// Records that the node's hello was refused for sharing no protocol version with this
    /// coordinator (written only when it says something new: a refused agent keeps trying).
    pub fn refuse_protocol(&self, id: &NodeId, versions: Incompatible) -> StoreResult<()> {
        let refused = Some(NodeProtocol::Refused(versions));
        self.write(|tx| match tx.node(id)? {
            Some(mut node) if node.protocol != refused => {
                node.protocol = refused;
                tx.put_node(&node)
            }
            _ => Ok(()),
        })
    }

    /// Sets and removes the node's labels (removals first); None for an unknown node.
    pub fn set_labels(
        &self,
        id: &NodeId,
        set: &[(String, String)],
        remove: &[String],
    ) -> StoreResult<Option<NodeRecord>> {
        self.write(|tx| {
            let Some(mut node) = tx.node(id)? else {
                return Ok(None);
            };
            for key in remove {
                node.labels.remove(key);
            }
            node.labels.extend(set.iter().cloned());
            tx.put_node(&node)?;
            Ok(Some(node))
        })
    }

    /// How many runs each node holds that are not final (nodes with none are absent).
    pub fn runs_out(&self) -> StoreResult<BTreeMap<NodeId, u64>> {
        self.read(|tx| tx.active_counts())
    }

    /// Starts a session: a new, higher generation, and a fresh lease.
    pub fn open_session(&self, id: &NodeId, lease_until_ms: u64) -> StoreResult<u64> {
        match self.apply_one(&Change::OpenSession {
            node_id: id.clone(),
            lease_until_ms,
            at: None,
            protocol: ProtocolVersion::CURRENT,
        })? {
            Applied::Generation(generation) => Ok(generation),
            other => Err(mismatch("a session", &other)),
        }
    }

    /// Records a heartbeat (and new facts, when given) and extends the lease.
    pub fn heartbeat(
        &self,
        id: &NodeId,
        now_ms: u64,
        lease_until_ms: u64,
        facts: Option<Facts>,
    ) -> StoreResult<()> {
        let beat = Beat {
            node_id: id.clone(),
            at_ms: Some(now_ms),
            lease_until_ms,
        };
        let change = match facts {
            Some(facts) => Change::Facts {
                beat,
                facts: Box::new(facts),
            },
            None => Change::Beats(vec![beat]),
        };
        let mut applied = self.apply(std::slice::from_ref(&change));
        applied.pop().unwrap_or(Ok(Applied::Done)).map(drop)
    }

    /// Applies many changes in one transaction (one commit for all of them), and answers each.
    /// The leases they give are written first, apart ([`Change::leases`]). When one change
    /// fails, the transaction is given up and each half is applied alone, down to the change
    /// that fails by itself; when the database cannot be reached, each is answered with that
    /// outage.
    pub fn apply(&self, changes: &[Change]) -> Vec<StoreResult<Applied>> {
        // Leases are blind, monotonic writes: written apart, never conflicting with the rules, and
        // never held locked by a batch that the heartbeats' writer would wait for or pass by.
        let beats: Vec<Beat> = changes.iter().flat_map(Change::leases).collect();
        let beats_written = match beats.is_empty() {
            true => Ok(()),
            false => self.write_every_lease(beats),
        };
        let applied = self.apply_rules(changes);
        match beats_written {
            Ok(()) => applied,
            Err(e) => (applied.into_iter().zip(changes))
                .map(|(applied, change)| match change {
                    Change::Beats(_) => Err(outage_of(&e)),
                    _ => applied,
                })
                .collect(),
        }
    }

    /// The rules' part of [`Store::apply`]: everything but the leases, in one transaction.
    fn apply_rules(&self, changes: &[Change]) -> Vec<StoreResult<Applied>> {
        let keep = self.keep_final_runs;
        let runs: Vec<RunId> = changes.iter().flat_map(Change::runs).cloned().collect();
        let nodes: Vec<NodeId> = changes.iter().filter_map(Change::node).cloned().collect();
        let write = |backend: &dyn Backend,
                     f: &mut dyn FnMut(&mut dyn WriteTx) -> StoreResult<()>| {
            match changes.len() {
                1 => backend.write(f),
                _ => backend.write_batch(f),
            }
        };
        let together = self.write_with(write, |tx| {
            tx.read_runs_ahead(&runs)?;
            tx.read_nodes_ahead(&nodes)?;
            changes
                .iter()
                .map(|change| apply_change(tx, keep, change))
                .collect::<StoreResult<Vec<Applied>>>()
        });
        match together {
            Ok(applied) => applied.into_iter().map(Ok).collect(),
            Err(e) if e.is_outage() => changes.iter().map(|_| Err(outage_of(&e))).collect(),
            // A change the rules refuse, or conflicts that outlasted a batch's patience: each half
            // alone, down to the change that fails by itself.
            Err(e) if changes.len() > 1 => {
                tracing::info!(
                    changes = changes.len(),
                    "a batch failed whole, applied in halves: {e}"
                );
                let (first, second) = changes.split_at(changes.len() / 2);
                let mut applied = self.apply_rules(first);
                applied.extend(self.apply_rules(second));
                applied
            }
            Err(e) => vec![Err(e)],
        }
    }

    /// Writes heartbeats (see [`Backend::write_leases`]), apart from any other change; answers
    /// those left for the next write, their node's record busy now.
    pub fn write_leases(&self, beats: &[Beat]) -> StoreResult<Vec<Beat>> {
        self.backend.write_leases(beats)
    }

    /// Writes heartbeats, trying those left again until each is written: a record is held only
    /// for one transaction.
    fn write_every_lease(&self, mut beats: Vec<Beat>) -> StoreResult<()> {
        let since = std::time::Instant::now();
        loop {
            beats = self.backend.write_leases(&beats)?;
            if beats.is_empty() {
                return Ok(());
            }
            if since.elapsed() > std::time::Duration::from_secs(10) {
                return Err(StoreError::Db(format!(
                    "the records of {} node(s) stayed held by other transactions for 10 s; their heartbeats go with the next",
                    beats.len()
                )));
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    fn apply_one(&self, change: &Change) -> StoreResult<Applied> {
        let mut applied = self.apply(std::slice::from_ref(change));
        applied.pop().unwrap_or(Ok(Applied::Done))
    }

    /// Of `digests`, those no stored run refers to: blobs that may be removed.
    pub fn unreferenced(&self, digests: &[Digest]) -> StoreResult<Vec<Digest>> {
        self.read(|tx| {
            let mut out = Vec::new();
            for digest in digests {
                if tx.program_refs(digest)? == 0 {
                    out.push(*digest);
                }
            }
            Ok(out)
        })
    }

    /// Records a set and its runs (all `waiting`, none accepted) in one transaction. Each run
    /// holds a reference on each content it names (its program, its inputs) until it is pruned;
    /// the content itself is the caller's blob store's.
    pub fn create_set(&self, set_id: &SetId, runs: &[RunRow]) -> StoreResult<()> {
        let refused = |why: String| Err(StoreError::Refused(why));
        if runs.is_empty() {
            return refused(format!("the set {set_id} has no runs"));
        }
        if let Some(run) = runs
            .iter()
            .find(|r| r.set_id != *set_id || r.state != RunState::Waiting || r.accepted)
        {
            return refused(format!(
                "the run {} is not a new waiting run of the set {set_id}",
                run.id
            ));
        }
        let mut uses: BTreeMap<Digest, u64> = BTreeMap::new();
        for digest in runs.iter().flat_map(RunRow::content) {
            *uses.entry(digest).or_default() += 1;
        }
        let ids: Vec<RunId> = runs.iter().map(|r| r.id.clone()).collect();
        self.backend.write_placing(&mut |tx| {
            // First: a drain, retire, revoke or forget that committed before is seen below, and
            // one under way is redone after this commits (and sees these runs).
            tx.hold_node_changes()?;
            if tx.set(set_id)?.is_some() {
                return refused(format!("the set {set_id} exists already"));
            }
            for (digest, count) in &uses {
                tx.add_program_refs(digest, *count)?;
            }
            let closed: BTreeMap<NodeId, NodeRecord> = (tx.closed_nodes()?.into_iter())
                .map(|n| (n.id.clone(), n))
                .collect();
            if let Some((run, node)) =
                (runs.iter()).find_map(|run| Some((run, closed.get(&run.node_id)?)))
            {
                let why = node.ended.map_or("draining", |e| e.end.as_str());
                return refused(format!(
                    "the node {} is {why}: it takes no new run",
                    run.node_id
                ));
            }
            tx.put_new_runs(runs)?;
            tx.put_set(set_id, &ids)
        })
    }

    /// The run ids of a set in order, or None for an unknown set (or one pruned by the
    /// retention).
    pub fn set_ids(&self, set_id: &SetId) -> StoreResult<Option<Vec<RunId>>> {
        self.read(|tx| tx.set(set_id))
    }

    /// The runs of `ids` that are stored, in that order.
    pub fn runs_in_order(&self, ids: &[RunId]) -> StoreResult<Vec<RunRow>> {
        self.read(|tx| runs_of(tx, ids))
    }

    /// Every node's lease end and capacity (see [`ReadTx::node_briefs`]).
    pub fn node_briefs(&self) -> StoreResult<Vec<NodeBrief>> {
        self.read(|tx| tx.node_briefs())
    }

    /// The runs of a set, or None for an unknown set (or one pruned by the retention).
    pub fn set_runs(&self, set_id: &SetId) -> StoreResult<Option<Vec<RunRow>>> {
        self.read(|tx| {
            let Some(ids) = tx.set(set_id)? else {
                return Ok(None);
            };
            runs_of(tx, &ids).map(Some)
        })
    }

    pub fn run(&self, id: &RunId) -> StoreResult<Option<RunRow>> {
        self.read(|tx| tx.run(id))
    }

    /// Every run not yet final, by id.
    pub fn active_runs(&self) -> StoreResult<Vec<ActiveRun>> {
        let mut runs = self.read(|tx| tx.active_brief())?;
        runs.sort_unstable_by(|a, b| a.id.cmp(&b.id));
        Ok(runs)
    }

    /// The runs waiting for `node_id` that it has not accepted yet, oldest first (by id among
    /// runs created together); read by the node's waiting index, so the cost follows this
    /// node's work, not the fleet's.
    pub fn waiting_runs(&self, node_id: &NodeId) -> StoreResult<Vec<RunRow>> {
        self.dispatch_view(node_id).map(|(waiting, _, _)| waiting)
    }

    /// Records the node's answers to starts, in one transaction: each run is the node's now;
    /// an error answer fails a run not yet final.
    pub fn accept_runs(&self, answers: &[(RunId, Option<String>)]) -> StoreResult<()> {
        self.apply_one(&Change::Accept(answers.to_vec())).map(drop)
    }

    /// Stores a node's events once each (dedupe by id) and applies them to their runs, only
    /// forward; returns the highest id stored from that node, which the node may forget up to.
    pub fn apply_events(&self, node_id: &NodeId, events: &[NodeEvent]) -> StoreResult<u64> {
        let change = Change::Events {
            node_id: node_id.clone(),
            events: events.to_vec(),
        };
        match self.apply_one(&change)? {
            Applied::Events { up_to, .. } => Ok(up_to),
            other => Err(mismatch("events", &other)),
        }
    }

    /// Records that the coordinator at `address` serves this store now.
    pub fn heard_coordinator(&self, address: &str, now_ms: u64) -> StoreResult<()> {
        self.write(|tx| tx.put_coordinator(address, now_ms))
    }

    /// The coordinators that said they serve this store at `since_ms` or later, by address.
    pub fn coordinators_since(&self, since_ms: u64) -> StoreResult<Vec<String>> {
        let mut live: Vec<String> = (self.read(|tx| tx.coordinators())?)
            .into_iter()
            .filter(|(_, seen)| *seen >= since_ms)
            .map(|(address, _)| address)
            .collect();
        live.sort();
        Ok(live)
    }

    /// See [`Backend::wait_for_waiting`].
    pub fn wait_for_waiting(&self, timeout: std::time::Duration) -> Option<StoreResult<bool>> {
        self.backend.wait_for_waiting(timeout)
    }

    /// The nodes that have runs waiting for them (for a coordinator's periodic look, which
    /// wakes those of its sessions).
    pub fn waiting_nodes(&self) -> StoreResult<Vec<NodeId>> {
        self.read(|tx| tx.waiting_nodes())
    }

    /// Ends a run not yet final as `failed` or `lost` with its reason (the sweep's verdict);
    /// a final run stays as it is. Returns the run as it is now, None for an unknown run.
    pub fn fail_run(
        &self,
        id: &RunId,
        state: RunState,
        reason: &str,
    ) -> StoreResult<Option<RunRow>> {
        if !matches!(state, RunState::Failed | RunState::Lost) {
            return Err(StoreError::Refused(format!(
                "a run cannot be failed as {state}"
            )));
        }
        let keep = self.keep_final_runs;
        self.write(|tx| end_run(tx, keep, id, state, reason))
    }

    /// The sweep's `lost` verdict on a run whose node's lease had passed at `judged_at_ms`,
    /// given only if it still has in this transaction: a node heard since (back in a session
    /// while a slow sweep went on) keeps its run, which is answered as it is.
    pub fn lose_run(
        &self,
        id: &RunId,
        reason: &str,
        judged_at_ms: u64,
    ) -> StoreResult<Option<RunRow>> {
        let keep = self.keep_final_runs;
        self.write(|tx| {
            let Some(run) = tx.run(id)? else {
                return Ok(None);
            };
            let heard = (tx.node(&run.node_id)?).is_some_and(|n| n.lease_until_ms > judged_at_ms);
            if heard {
                return Ok(Some(run));
            }
            end_run(tx, keep, id, RunState::Lost, reason)
        })
    }
}

/// Ends a run not yet final as `state` (failed or lost) with `reason`; a lost run is placed
/// again when its set asked for retries.
fn end_run(
    tx: &mut dyn WriteTx,
    keep: u64,
    id: &RunId,
    state: RunState,
    reason: &str,
) -> StoreResult<Option<RunRow>> {
    let mut moved = false;
    let row = change_run(tx, keep, id, &mut |r| {
        moved = r.state.may_become(state);
        if moved {
            r.state = state;
            r.error = Some(reason.to_string());
        }
        moved
    })?;
    match row {
        Some(row) if moved && state == RunState::Lost => place_again(tx, row).map(Some),
        row => Ok(row),
    }
}

/// What [`Store::end_node`] did.
#[derive(Debug)]
pub enum EndOutcome {
    Unknown,
    /// Retiring a node that holds this many runs, without discard: nothing changed.
    HoldsRuns(u64),
    /// The node was already ended the other way: nothing changed.
    AlreadyEnded(NodeEnd),
    /// The node is ended (now or before); `lost` runs it held ended with it.
    Ended {
        node: Box<NodeRecord>,
        lost: u64,
    },
}

/// What [`Store::forget_node`] did.
#[derive(Debug)]
pub enum ForgetOutcome {
    Unknown,
    /// The node holds its lease and was not ended: nothing changed.
    Live,
    Forgotten(Box<NodeRecord>),
}

/// One change a session asks for; many are applied in one transaction by [`Store::apply`].
#[derive(Debug, Clone)]
pub enum Change {
    /// A new session: the next generation, and a fresh lease, held by the coordinator `at`.
    OpenSession {
        node_id: NodeId,
        lease_until_ms: u64,
        at: Option<String>,
        protocol: ProtocolVersion,
    },
    /// Heartbeats: only the lease and the time heard are written.
    Beats(Vec<Beat>),
    /// New facts, with the heartbeat they came with.
    Facts { beat: Beat, facts: Box<Facts> },
    /// A node's answers to starts: (run, the error when it refused).
    Accept(Vec<(RunId, Option<String>)>),
    /// A node's events, stored once each.
    Events {
        node_id: NodeId,
        events: Vec<NodeEvent>,
    },
}

impl Change {
    /// The runs the change reads, so a batch can read them all at once.
    fn runs(&self) -> impl Iterator<Item = &RunId> {
        let (answers, events): (&[_], &[_]) = match self {
            Change::Accept(answers) => (answers, &[]),
            Change::Events { events, .. } => (&[], events),
            _ => (&[], &[]),
        };
        (answers.iter().map(|(id, _)| id)).chain(events.iter().map(NodeEvent::run_id))
    }

    /// The leases the change gives, written apart from its transaction ([`Store::apply`]).
    fn leases(&self) -> Vec<Beat> {
        match self {
            Change::Beats(beats) => beats.clone(),
            Change::Facts { beat, .. } => vec![beat.clone()],
            Change::OpenSession {
                node_id,
                lease_until_ms,
                ..
            } => vec![Beat {
                node_id: node_id.clone(),
                at_ms: None,
                lease_until_ms: *lease_until_ms,
            }],
            Change::Accept(_) | Change::Events { .. } => Vec::new(),
        }
    }

    /// The node whose record the change reads, so a batch can read them all at once.
    fn node(&self) -> Option<&NodeId> {
        match self {
            Change::OpenSession { node_id, .. } | Change::Events { node_id, .. } => Some(node_id),
            Change::Facts { beat, .. } => Some(&beat.node_id),
            Change::Beats(_) | Change::Accept(_) => None,
        }
    }
}

/// What a [`Change`] left: a session's generation, the highest event id stored from the node
/// with the runs its events moved, or nothing to report.
#[derive(Debug, Clone, PartialEq)]
pub enum Applied {
    Generation(u64),
    Events { up_to: u64, moved: Vec<RunMoved> },
    Done,
}

/// A run that reached a new state in a committed change: what the metrics count.
#[derive(Debug, Clone, PartialEq)]
pub struct RunMoved {
    pub state: RunState,
    /// How it ended, when it is final and its node said.
    pub outcome: Option<Outcome>,
    pub created_ms: u64,
    /// When the change was applied, by the coordinator's clock.
    pub at_ms: u64,
}

/// The same outage, for each change of a batch.
fn outage_of(e: &StoreError) -> StoreError {
    match e {
        StoreError::Unreachable { url, reason, hint } => StoreError::Unreachable {
            url: url.clone(),
            reason: reason.clone(),
            hint,
        },
        other => StoreError::Db(other.to_string()),
    }
}

fn mismatch(what: &str, applied: &Applied) -> StoreError {
    StoreError::Db(format!("{what} was answered with {applied:?}"))
}

fn apply_change(tx: &mut dyn WriteTx, keep: u64, change: &Change) -> StoreResult<Applied> {
    match change {
        Change::OpenSession {
            node_id,
            at,
            protocol,
            ..
        } => {
            let mut node = known_node(tx, node_id)?;
            node.generation += 1;
            node.session_at = at.clone();
            node.protocol = Some(NodeProtocol::Speaks { version: *protocol });
            tx.put_node(&node)?;
            Ok(Applied::Generation(node.generation))
        }
        // Written apart, before the transaction (`Store::apply`).
        Change::Beats(_) => Ok(Applied::Done),
        Change::Facts { beat, facts } => {
            let mut node = known_node(tx, &beat.node_id)?;
            node.facts = Some(facts.as_ref().clone());
            tx.put_node(&node).map(|()| Applied::Done)
        }
        Change::Accept(answers) => {
            for (id, error) in answers {
                change_run(tx, keep, id, &mut |r| {
                    let mut changed = !r.accepted;
                    r.accepted = true;
                    if let Some(error) = error
                        && r.state.may_become(RunState::Failed)
                    {
                        r.state = RunState::Failed;
                        r.error = Some(error.clone());
                        changed = true;
                    }
                    changed
                })?;
            }
            Ok(Applied::Done)
        }
        Change::Events { node_id, events } => {
            let mut node = known_node(tx, node_id)?;
            let mut moved = Vec::new();
            for event in events {
                if event.id() <= node.last_event_id {
                    continue;
                }
                node.last_event_id = event.id();
                let Some(mut row) = tx.run(event.run_id())?.filter(|r| &r.node_id == node_id)
                else {
                    continue;
                };
                let before = Indexed::of(&row);
                let state_before = row.state;
                record_event(&mut row, event);
                row.updated_ms = now_ms();
                save_run(tx, keep, before, &row)?;
                if row.state != state_before {
                    moved.push(RunMoved {
                        state: row.state,
                        outcome: (row.report.as_ref()).and_then(|r| r.outcome.clone()),
                        created_ms: row.created_ms,
                        at_ms: row.updated_ms,
                    });
                }
            }
            tx.set_last_event_id(node_id, node.last_event_id)?;
            Ok(Applied::Events {
                up_to: node.last_event_id,
                moved,
            })
        }
    }
}

/// A run the node has not taken yet, in its node's waiting index.
fn is_waiting(run: &RunRow) -> bool {
    !run.accepted && !run.state.is_final()
}

/// Which indexes held a run before a change.
#[derive(Clone, Copy)]
struct Indexed {
    waiting: bool,
    active: bool,
}

impl Indexed {
    fn of(run: &RunRow) -> Indexed {
        Indexed {
            waiting: is_waiting(run),
            active: !run.state.is_final(),
        }
    }
}

/// Writes a changed run and moves it between the indexes: out of the waiting index once taken
/// or final, and retired once final.
fn save_run(tx: &mut dyn WriteTx, keep: u64, before: Indexed, run: &RunRow) -> StoreResult<()> {
    tx.put_run(run)?;
    if before.waiting && !is_waiting(run) {
        tx.remove_waiting(&run.id, &run.node_id)?;
    }
    if before.active && run.state.is_final() {
        retire(tx, keep, run)?;
    }
    Ok(())
}

/// Ends the runs `ids` names that are not final as `lost`, with `reason` (each placed again
/// when it has retries left); returns how many.
fn lose_runs(tx: &mut dyn WriteTx, keep: u64, ids: &[RunId], reason: &str) -> StoreResult<u64> {
    let mut lost = 0;
    for id in ids {
        let mut moved = false;
        let row = change_run(tx, keep, id, &mut |r| {
            moved = r.state.may_become(RunState::Lost);
            if moved {
                r.state = RunState::Lost;
                r.error = Some(reason.to_string());
            }
            moved
        })?;
        if let Some(row) = row.filter(|_| moved) {
            lost += 1;
            place_again(tx, row)?;
        }
    }
    Ok(lost)
}

/// A run lost with its machine, with retries left, is placed again on another node its
/// expression matches, least loaded first: the next attempt is a new row of its set, waiting
/// and naming this one, which names it in turn. Answers the lost row as it now is (unchanged
/// when no retry is left, or no other node matches).
fn place_again(tx: &mut dyn WriteTx, mut lost: RunRow) -> StoreResult<RunRow> {
    let Some(retry) = lost.retry.clone().filter(|r| r.left > 0) else {
        return Ok(lost);
    };
    let now = now_ms();
    let (nodes, out) = (tx.nodes()?, tx.active_counts()?);
    let Some(node) = (crate::placement::candidates(&nodes, &out, &retry.place, now).into_iter())
        .map(|(_, n)| n.id.clone())
        .find(|n| *n != lost.node_id)
    else {
        return Ok(lost);
    };
    let next = RunRow {
        id: crate::ids::new_run_id(),
        node_id: node,
        state: RunState::Waiting,
        created_ms: now,
        updated_ms: now,
        accepted: false,
        report: None,
        error: None,
        events: Vec::new(),
        retry: Some(Retry {
            left: retry.left - 1,
            place: retry.place,
        }),
        queued_for: None,
        attempt: lost.attempt + 1,
        previous: Some(lost.id.clone()),
        retried_as: None,
        ..lost.clone()
    };
    for digest in next.content() {
        tx.add_program_refs(&digest, 1)?;
    }
    tx.put_run(&next)?;
    tx.put_active(&next.id, &next.node_id)?;
    tx.put_waiting(&next.id, &next.node_id)?;
    let mut ids = tx.set(&lost.set_id)?.unwrap_or_default();
    ids.push(next.id.clone());
    tx.put_set(&lost.set_id, &ids)?;
    lost.retried_as = Some(next.id);
    // Retention may have pruned it already; a pruned row is not written back.
    if tx.run(&lost.id)?.is_some() {
        tx.put_run(&lost)?;
    }
    Ok(lost)
}

/// A node that sends anything has joined, so a missing record means the store is damaged.
/// A token a machine may still join with.
fn waiting(token: &TokenRecord, now_ms: u64) -> bool {
    token.spent_by.is_none() && token.bootstrap_failure.is_none() && now_ms < token.expires_at_ms
}

/// The order waiting runs go out in: as they were created, a set's runs in its order.
fn waiting_order(a: &RunRow, b: &RunRow) -> std::cmp::Ordering {
    (a.created_ms.cmp(&b.created_ms))
        .then_with(|| a.set_id.cmp(&b.set_id))
        .then_with(|| a.position.cmp(&b.position))
        .then_with(|| a.id.cmp(&b.id))
}

fn known_node<T: ReadTx + ?Sized>(tx: &T, id: &NodeId) -> StoreResult<NodeRecord> {
    tx.node(id)?
        .ok_or_else(|| StoreError::Corrupt(format!("node {id} (missing)")))
}

/// The runs under `ids` that exist, in that order.
/// The runs stored under `ids`, in the order of `ids` (one read for them all where it can).
fn runs_of<T: ReadTx + ?Sized>(tx: &T, ids: &[RunId]) -> StoreResult<Vec<RunRow>> {
    let mut found: std::collections::HashMap<RunId, RunRow> = (tx.runs(ids)?.into_iter())
        .map(|r| (r.id.clone(), r))
        .collect();
    Ok(ids.iter().filter_map(|id| found.remove(id)).collect())
}

/// Changes one run when `change` says it changed; a run becoming final is retired. Returns the
/// run as it is now.
fn change_run(
    tx: &mut dyn WriteTx,
    keep: u64,
    id: &RunId,
    change: &mut dyn FnMut(&mut RunRow) -> bool,
) -> StoreResult<Option<RunRow>> {
    let Some(mut row) = tx.run(id)? else {
        return Ok(None);
    };
    let before = Indexed::of(&row);
    if !change(&mut row) {
        return Ok(Some(row));
    }
    row.updated_ms = now_ms();
    save_run(tx, keep, before, &row)?;
    Ok(Some(row))
}

/// Records one event on its run and moves the run forward when the event allows. An unreadable
/// event is recorded as refused and changes nothing else.
fn record_event(row: &mut RunRow, event: &NodeEvent) {
    let event = match event {
        NodeEvent::Known(event) => event,
        NodeEvent::Unreadable {
            id, at_ms, reason, ..
        } => {
            row.events.push(EventRecord {
                id: *id,
                state: None,
                at_ms: *at_ms,
                refused: Some(reason.clone()),
            });
            return;
        }
    };
    row.events.push(EventRecord {
        id: event.id,
        state: Some(event.state),
        at_ms: event.at_unix_ms,
        refused: None,
    });
    // The node reports on the run: it has it, whether or not its answer to the start came.
    row.accepted = true;
    if !row.state.may_become(event.state) {
        return;
    }
    row.state = event.state;
    if event.state.is_final() {
        if let Some(error) = &event.report.error {
            row.error = Some(error.clone());
        }
        row.report = Some(event.report.clone());
    }
}

/// A run became final: out of the active index, into its node's retention order; beyond `keep`,
/// that node's oldest final runs are pruned. Per node, so a set spread over a fleet keeps every
/// row until each of its machines has ended `keep` newer runs.
fn retire(tx: &mut dyn WriteTx, keep: u64, run: &RunRow) -> StoreResult<()> {
    tx.remove_active(&run.id, &run.node_id)?;
    // One index entry read: a node with a long queue pays no more per run that ends.
    if !tx.holds_active(&run.node_id)?
        && let Some(mut node) = tx.node(&run.node_id)?
    {
        node.idle_since_ms = Some(run.updated_ms);
        tx.put_node(&node)?;
    }
    tx.push_final(&run.id, &run.node_id)?;
    while tx.final_count(&run.node_id)? > keep {
        let Some(oldest) = tx.pop_final(&run.node_id)? else {
            break;
        };
        prune(tx, &oldest)?;
    }
    Ok(())
}

/// Removes a final run, its set once it has no runs left, and its references on its content (a
/// blob with none left is the blob store's to remove).
fn prune(tx: &mut dyn WriteTx, id: &RunId) -> StoreResult<()> {
    let Some(run) = tx.run(id)? else {
        return Ok(());
    };
    tx.remove_run(id)?;
    if let Some(mut ids) = tx.set(&run.set_id)? {
        ids.retain(|r| r != id);
        if ids.is_empty() {
            tx.remove_set(&run.set_id)?;
        } else {
            tx.put_set(&run.set_id, &ids)?;
        }
    }
    for digest in run.content() {
        match tx.program_refs(&digest)?.saturating_sub(1) {
            0 => tx.remove_program(&digest)?,
            refs => tx.set_program_refs(&digest, refs)?,
        }
    }
    Ok(())
}

/// Whether `release add` took a release in, or had it already.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReleaseAdded {
    New,
    Already(Box<ReleaseRecord>),
}

fn text_of<T: serde::Serialize>(value: &T) -> String {
    // Cannot fail: plain data with string keys.
    serde_json::to_string(value).expect("fleet entries serialize")
}

fn fleet_json<T: serde::de::DeserializeOwned + Default>(
    tx: &dyn ReadTx,
    entry: FleetEntry,
) -> StoreResult<T> {
    match tx.fleet_entry(entry)? {
        None => Ok(T::default()),
        Some(text) => serde_json::from_str(&text)
            .map_err(|e| StoreError::Corrupt(format!("the fleet's {}: {e}", entry.key()))),
    }
}

fn release_roots_in(tx: &dyn ReadTx) -> StoreResult<Vec<PinnedKey>> {
    fleet_json(tx, FleetEntry::ReleaseRoots)
}

fn release_trust_in(tx: &dyn ReadTx) -> StoreResult<ReleaseTrust> {
    Ok(ReleaseTrust {
        roots: release_roots_in(tx)?,
        revoked: fleet_json(tx, FleetEntry::RevokedReleaseKeys)?,
    })
}

fn releases_in(tx: &dyn ReadTx) -> StoreResult<Vec<ReleaseRecord>> {
    fleet_json(tx, FleetEntry::Releases)
}
