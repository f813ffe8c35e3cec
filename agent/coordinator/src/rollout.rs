//! A staged rollout of a release across the fleet: canaries first, then each wave (a share of the
//! eligible machines, cumulative) once the one before is healthy for `wait`; it halts by itself
//! when the share of machines of a stage that failed (reverted, refused, or no outcome in time)
//! passes `halt_at`, and says why. Drained machines, and those without a session, wait; a machine
//! that joins later gets the release at its next session, also once the rollout is done.
//!
//! The rollout lives in the store's fleet table and only there: each step of the controller
//! (every serving coordinator runs one) reads it and writes it back in one transaction, and a
//! machine is sent the release only by the coordinator whose transaction assigned it, so on a
//! shared store two controllers never send one machine the release twice.
use crate::nodes::{NodeState, NodeView};
use crate::placement::Selector;
use crate::store::FleetEntry;
use crate::{Coordinator, CoordinatorError};
use fleet_proto::clock::now_ms;
use fleet_proto::release::{ReleaseOffer, UpdateOutcome};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// How long a machine sent the release has to report how it went.
pub const OUTCOME_TIMEOUT_MS: u64 = 120_000;

/// What `rollout start` asks for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RolloutPlan {
    /// The release's sequence.
    pub release: u64,
    pub canaries: u32,
    /// Shares of the eligible machines, in percent, growing, the last 100.
    pub waves: Vec<u32>,
    pub wait_ms: u64,
    /// The share of failed machines in a stage, in percent, past which the rollout halts.
    pub halt_at: u32,
    /// Only the machines whose facts and labels match (`run --where`'s expressions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum RolloutState {
    Running,
    Paused,
    Halted {
        reason: String,
    },
    Aborted,
    /// Every stage passed; machines that come later still get the release.
    Done,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum MachineOutcome {
    Pending,
    Kept,
    Failed { reason: String },
}

/// A rollout's machines by outcome.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OutcomeCounts {
    pub sent: u64,
    pub kept: u64,
    pub failed: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Machine {
    /// 0: a canary; K: wave K.
    pub stage: usize,
    pub sent_at_ms: u64,
    pub outcome: MachineOutcome,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rollout {
    pub plan: RolloutPlan,
    #[serde(flatten)]
    pub state: RolloutState,
    /// 0 while the canaries go; K while wave K does.
    pub stage: usize,
    /// When every machine of the stage reported and it was healthy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage_healthy_at_ms: Option<u64>,
    pub machines: BTreeMap<String, Machine>,
    pub started_at_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at_ms: Option<u64>,
}

impl Rollout {
    pub fn new(plan: RolloutPlan, now: u64) -> Rollout {
        Rollout {
            plan,
            state: RolloutState::Running,
            stage: 0,
            stage_healthy_at_ms: None,
            machines: BTreeMap::new(),
            started_at_ms: now,
            finished_at_ms: None,
        }
    }

    fn stage_name(&self, stage: usize) -> String {
        match stage {
            0 => "the canaries".into(),
            k => format!("wave {k} ({}%)", self.plan.waves[k - 1]),
        }
    }

    /// How many machines were sent the release, and of them how many kept it and failed.
    pub fn counts(&self) -> OutcomeCounts {
        let mut counts = OutcomeCounts::default();
        for machine in self.machines.values() {
            counts.sent += 1;
            match machine.outcome {
                MachineOutcome::Kept => counts.kept += 1,
                MachineOutcome::Failed { .. } => counts.failed += 1,
                MachineOutcome::Pending => {}
            }
        }
        counts
    }

    /// One line for people: `release 8: running, wave 2 (10%): 12 of 15 kept, 1 failed`.
    pub fn summary(&self) -> String {
        let c = self.counts();
        let stage = match self.state {
            RolloutState::Running | RolloutState::Paused => {
                format!(", {}", self.stage_name(self.stage))
            }
            _ => String::new(),
        };
        format!(
            "release {}: {}{stage}: {} of {} kept, {} failed",
            self.plan.release,
            state_word(&self.state),
            c.kept,
            c.sent,
            c.failed
        )
    }

    /// How many machines of `eligible` the current stage covers, counting those before it.
    fn target(&self, eligible: usize) -> usize {
        match self.stage {
            0 => (self.plan.canaries as usize).min(eligible),
            k => (self.plan.waves[k - 1] as usize * eligible).div_ceil(100),
        }
    }

    /// One step of the controller at `now`, over the fleet's `nodes`: reads the outcomes from the
    /// facts, halts or advances, and assigns machines; answers the node ids to send the release.
    pub fn step(
        &mut self,
        nodes: &[NodeView],
        selector: Option<&Selector>,
        now: u64,
    ) -> Vec<String> {
        let release = self.plan.release;
        for node in nodes {
            let Some(machine) = self.machines.get_mut(&node.id) else {
                continue;
            };
            if machine.outcome != MachineOutcome::Pending {
                continue;
            }
            machine.outcome = outcome_of(node, release).unwrap_or_else(|| {
                match now >= machine.sent_at_ms + OUTCOME_TIMEOUT_MS {
                    true => MachineOutcome::Failed {
                        reason: format!("no outcome within {} s", OUTCOME_TIMEOUT_MS / 1000),
                    },
                    false => MachineOutcome::Pending,
                }
            });
        }
        if !matches!(self.state, RolloutState::Running | RolloutState::Done) {
            return Vec::new();
        }
        let eligible: Vec<&NodeView> = (nodes.iter())
            .filter(|n| n.ended.is_none() && selector.is_none_or(|s| s.matches(*n)))
            .collect();
        if self.state == RolloutState::Running && !self.judge(now, &eligible) {
            return Vec::new();
        }
        let covered = match self.state {
            RolloutState::Done => eligible.len(),
            _ => self.target(eligible.len()),
        };
        let mut send = Vec::new();
        let mut assigned = self.machines.len();
        for node in eligible {
            if assigned >= covered {
                break;
            }
            if self.machines.contains_key(&node.id) || !ready(node) {
                continue;
            }
            let on_it = runs(node) == Some(release);
            self.machines.insert(
                node.id.clone(),
                Machine {
                    stage: self.stage,
                    sent_at_ms: now,
                    outcome: match on_it {
                        true => MachineOutcome::Kept,
                        false => MachineOutcome::Pending,
                    },
                },
            );
            assigned += 1;
            if !on_it {
                send.push(node.id.clone());
            }
        }
        send
    }

    /// Halts on too many failures in the current stage, or moves on once it was healthy for
    /// `wait`; answers whether machines may be assigned now.
    fn judge(&mut self, now: u64, eligible: &[&NodeView]) -> bool {
        let stage: Vec<(&String, &Machine)> = (self.machines.iter())
            .filter(|(_, m)| m.stage == self.stage)
            .collect();
        let failed: Vec<(&String, &str)> = (stage.iter())
            .filter_map(|(id, m)| match &m.outcome {
                MachineOutcome::Failed { reason } => Some((*id, reason.as_str())),
                _ => None,
            })
            .collect();
        let total = stage.len().max(1);
        if failed.len() * 100 > self.plan.halt_at as usize * total {
            let (id, reason) = failed[0];
            self.state = RolloutState::Halted {
                reason: format!(
                    "{} of {} machines of {} failed ({}%, above the {}% allowed); {id}: {reason}",
                    failed.len(),
                    stage.len(),
                    self.stage_name(self.stage),
                    failed.len() * 100 / total,
                    self.plan.halt_at
                ),
            };
            self.finished_at_ms = Some(now);
            return false;
        }
        let reported = stage
            .iter()
            .all(|(_, m)| m.outcome != MachineOutcome::Pending);
        // Full once it covers its share, or once no machine that could take it is left (those
        // drained or away get it when they can, as machines that join later do).
        let waiting = (eligible.iter()).any(|n| ready(n) && !self.machines.contains_key(&n.id));
        let full = self.machines.len() >= self.target(eligible.len()) || !waiting;
        if !(reported && full && !stage.is_empty()) {
            return true;
        }
        let healthy_at = *self.stage_healthy_at_ms.get_or_insert(now);
        if now < healthy_at + self.plan.wait_ms {
            return false;
        }
        if self.stage == self.plan.waves.len() {
            self.state = RolloutState::Done;
            self.finished_at_ms = Some(now);
        } else {
            self.stage += 1;
            self.stage_healthy_at_ms = None;
        }
        true
    }
}

/// What the release is on this machine, by its facts.
fn outcome_of(node: &NodeView, release: u64) -> Option<MachineOutcome> {
    let facts = node.facts.as_ref()?.release.as_ref()?;
    match &facts.update {
        Some(UpdateOutcome::Kept { to, .. }) if *to == release => Some(MachineOutcome::Kept),
        Some(UpdateOutcome::Reverted { to, reason, .. }) if *to == release => {
            Some(MachineOutcome::Failed {
                reason: format!("reverted: {reason}"),
            })
        }
        Some(UpdateOutcome::Refused { sequence, reason }) if *sequence == release => {
            Some(MachineOutcome::Failed {
                reason: format!("refused: {reason}"),
            })
        }
        _ if facts.sequence == release && facts.update.is_none() => Some(MachineOutcome::Kept),
        _ => None,
    }
}

/// The release a machine runs, by its facts.
fn runs(node: &NodeView) -> Option<u64> {
    Some(node.facts.as_ref()?.release.as_ref()?.sequence)
}

/// Whether a machine can take the release now: in session, taking work, of an agent that updates.
fn ready(node: &NodeView) -> bool {
    let speaks = matches!(node.protocol, Some(crate::store::NodeProtocol::Speaks { version }) if version.0 >= 2);
    node.state == NodeState::Joined && node.drain.is_none() && speaks
}

impl Coordinator {
    /// Starts a rollout of `plan`; refused while another one runs or is paused.
    pub fn start_rollout(&self, plan: RolloutPlan) -> Result<Rollout, CoordinatorError> {
        let bad = |m: String| CoordinatorError::Request(m);
        if let Some(text) = &plan.selector {
            Selector::parse(text)?;
        }
        if plan.waves.is_empty()
            || plan.waves.last() != Some(&100)
            || plan.waves.windows(2).any(|w| w[0] >= w[1])
            || plan.waves[0] == 0
        {
            return Err(bad(format!(
                "--waves {:?} must grow and end at 100%, e.g. 1%,10%,50%,100%",
                plan.waves
            )));
        }
        (self.store().sendable_release(Some(plan.release), now_ms()))
            .map_err(crate::release::refusal_as_request)?;
        let started = self.store().change_fleet_value(FleetEntry::Rollout, |current: Option<Rollout>| {
            if let Some(r) = &current
                && matches!(r.state, RolloutState::Running | RolloutState::Paused)
            {
                return Err(crate::store::StoreError::Refused(format!(
                    "a rollout of release {} is under way: abort it first (`fleet-coordinator rollout abort`)",
                    r.plan.release
                )));
            }
            let rollout = Rollout::new(plan.clone(), now_ms());
            Ok((Some(rollout.clone()), rollout))
        })?;
        Ok(started)
    }

    /// The fleet's rollout, if one was ever started.
    pub fn rollout(&self) -> Result<Option<Rollout>, CoordinatorError> {
        Ok(self.store().fleet_value(FleetEntry::Rollout)?)
    }

    /// Pauses, resumes or aborts the rollout.
    pub fn set_rollout(&self, to: RolloutState) -> Result<Rollout, CoordinatorError> {
        let changed =
            self.store()
                .change_fleet_value(FleetEntry::Rollout, |current: Option<Rollout>| {
                    let Some(mut rollout) = current else {
                        return Err(crate::store::StoreError::Refused(
                            "no rollout was started: see `fleet-coordinator rollout start --help`"
                                .into(),
                        ));
                    };
                    let allowed = matches!(
                        (&rollout.state, &to),
                        (RolloutState::Running, RolloutState::Paused)
                            | (RolloutState::Paused, RolloutState::Running)
                            | (RolloutState::Halted { .. }, RolloutState::Running)
                            | (
                                RolloutState::Running
                                    | RolloutState::Paused
                                    | RolloutState::Halted { .. },
                                RolloutState::Aborted
                            )
                    );
                    if !allowed {
                        return Err(crate::store::StoreError::Refused(format!(
                            "the rollout of release {} is {}: it cannot become {}",
                            rollout.plan.release,
                            state_word(&rollout.state),
                            state_word(&to)
                        )));
                    }
                    if let (RolloutState::Halted { .. }, RolloutState::Running) =
                        (&rollout.state, &to)
                    {
                        // Resumed past a halt: the failures stay recorded, the stage is judged afresh.
                        rollout.stage_healthy_at_ms = None;
                        for m in rollout.machines.values_mut() {
                            if m.stage == rollout.stage
                                && matches!(m.outcome, MachineOutcome::Failed { .. })
                            {
                                m.stage = usize::MAX;
                            }
                        }
                        rollout.finished_at_ms = None;
                    }
                    rollout.state = to.clone();
                    Ok((Some(rollout.clone()), rollout))
                })?;
        Ok(changed)
    }

    /// Halts the rollout of `release`, if it still runs or is done, for `reason`.
    fn halt_rollout(&self, release: u64, reason: String) -> Result<(), CoordinatorError> {
        tracing::warn!("the rollout of release {release} halts: {reason}");
        self.store()
            .change_fleet_value(FleetEntry::Rollout, |current: Option<Rollout>| {
                let Some(mut r) = current else {
                    return Ok((None, ()));
                };
                if r.plan.release != release
                    || !matches!(r.state, RolloutState::Running | RolloutState::Done)
                {
                    return Ok((None, ()));
                }
                r.state = RolloutState::Halted {
                    reason: reason.clone(),
                };
                Ok((Some(r), ()))
            })?;
        Ok(())
    }

    /// One step of the rollout controller (blocking): reads the fleet and steps the rollout in
    /// one transaction; answers the release (as checked again now) and the machines this step
    /// assigned, to be sent it.
    /// A done rollout is stepped only when `done_too` (it can only reach machines that came since).
    pub fn step_rollout(
        &self,
        done_too: bool,
    ) -> Result<Option<(ReleaseOffer, Vec<String>)>, CoordinatorError> {
        let Some(rollout) = self.rollout()? else {
            return Ok(None);
        };
        if !matches!(rollout.state, RolloutState::Running | RolloutState::Done) {
            return Ok(None);
        }
        let now = now_ms();
        let record = match self
            .store()
            .sendable_release(Some(rollout.plan.release), now)
        {
            Ok(record) => record,
            // Its key revoked, its root rotated away or its manifest expired: it halts, saying so.
            Err(crate::store::StoreError::Refused(reason)) => {
                self.halt_rollout(rollout.plan.release, reason)?;
                return Ok(None);
            }
            Err(e) => return Err(e.into()),
        };
        if rollout.state == RolloutState::Done && !done_too {
            return Ok(None);
        }
        let selector = match &rollout.plan.selector {
            Some(text) => Some(Selector::parse(text)?),
            None => None,
        };
        let nodes = self.nodes_matching(&Default::default())?;
        let send =
            self.store()
                .change_fleet_value(FleetEntry::Rollout, |current: Option<Rollout>| {
                    let Some(mut rollout) = current else {
                        return Ok((None, Vec::new()));
                    };
                    let before = rollout.clone();
                    let send = rollout.step(&nodes, selector.as_ref(), now);
                    let write = (rollout != before).then_some(rollout);
                    Ok((write, send))
                })?;
        Ok(Some((record.offer(), send)))
    }

    /// Sends `release` to each of `nodes`, many at once; a machine that cannot take it fails in
    /// the rollout, with the reason, in one write.
    pub async fn send_rollout(
        self: &std::sync::Arc<Self>,
        offer: ReleaseOffer,
        nodes: Vec<String>,
    ) -> Result<(), CoordinatorError> {
        let release = offer.read_unchecked().map_or(0, |m| m.sequence);
        let mut sends = tokio::task::JoinSet::new();
        let mut failed = Vec::new();
        for node in nodes {
            if sends.len() >= SENDS_AT_ONCE
                && let Some(Ok(Some(f))) = sends.join_next().await
            {
                failed.push(f);
            }
            let (coordinator, offer) = (self.clone(), offer.clone());
            sends.spawn(async move {
                let id = fleet_proto::NodeId::new(node.clone());
                let sent = coordinator.send_update(&id, offer).await;
                match sent {
                    // The node refused the release: a failure now, with the node's line.
                    Err(e @ CoordinatorError::Refused(_)) => Some((node, e.to_string())),
                    // Cut before an answer (it may have swapped and exec'd, the answer lost with
                    // the connection) or not reached: its facts say how it went, or the outcome
                    // timeout fails it.
                    Err(e) => {
                        tracing::info!(%node, "no answer to the release yet, waiting for its facts: {e}");
                        None
                    }
                    Ok(_) => None,
                }
            });
        }
        while let Some(done) = sends.join_next().await {
            if let Ok(Some(f)) = done {
                failed.push(f);
            }
        }
        if failed.is_empty() {
            return Ok(());
        }
        for (node, reason) in &failed {
            tracing::warn!(%node, "the rollout could not send release {release}: {reason}");
        }
        self.with_store(move |store| {
            store.change_fleet_value(FleetEntry::Rollout, |current: Option<Rollout>| {
                let Some(mut r) = current else {
                    return Ok((None, ()));
                };
                for (node, reason) in &failed {
                    if let Some(m) = r.machines.get_mut(node)
                        && m.outcome == MachineOutcome::Pending
                    {
                        m.outcome = MachineOutcome::Failed {
                            reason: reason.clone(),
                        };
                    }
                }
                Ok((Some(r), ()))
            })
        })
        .await?;
        Ok(())
    }
}

/// Releases sent at once by one controller step.
const SENDS_AT_ONCE: usize = 256;

pub fn state_word(state: &RolloutState) -> &'static str {
    match state {
        RolloutState::Running => "running",
        RolloutState::Paused => "paused",
        RolloutState::Halted { .. } => "halted",
        RolloutState::Aborted => "aborted",
        RolloutState::Done => "done",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nodes::NodeStatus;
    use crate::store::NodeProtocol;
    use fleet_proto::facts::Facts;
    use fleet_proto::release::ReleaseFacts;
    use fleet_proto::version::ProtocolVersion;

    fn node(id: usize, update: Option<UpdateOutcome>, sequence: u64) -> NodeView {
        NodeView {
            id: format!("n-{id:02}"),
            status: NodeStatus::Joined,
            state: NodeState::Joined,
            name: None,
            public_key: "ed25519:k".into(),
            labels: Default::default(),
            joined_at_ms: id as u64,
            last_heartbeat_ms: Some(1),
            sessions: 1,
            facts: Some(Facts {
                arch: "x86_64".into(),
                cpus: 2,
                memory_bytes: 1,
                disk_free_bytes: 1,
                kernel: "6".into(),
                os: "Debian".into(),
                agent_version: "0.1.0".into(),
                accelerators: Vec::new(),
                max_runs: None,
                measured_link: None,
                release: Some(ReleaseFacts { sequence, update }),
                engine: None,
                content: None,
            }),
            error: None,
            runs_out: 0,
            drain: None,
            drained_since_ms: None,
            capacity: None,
            capacity_set: None,
            ended: None,
            idle_since_ms: None,
            protocol: Some(NodeProtocol::Speaks {
                version: ProtocolVersion(2),
            }),
        }
    }

    fn plan(canaries: u32, waves: &[u32], halt_at: u32) -> RolloutPlan {
        RolloutPlan {
            release: 7,
            canaries,
            waves: waves.to_vec(),
            wait_ms: 1_000,
            halt_at,
            selector: None,
        }
    }

    /// The fleet as its facts say after the machines in `kept` took release 7.
    fn fleet(size: usize, kept: &[String]) -> Vec<NodeView> {
        (0..size)
            .map(|i| {
                let id = format!("n-{i:02}");
                match kept.contains(&id) {
                    true => node(i, Some(UpdateOutcome::Kept { from: 5, to: 7 }), 7),
                    false => node(i, None, 5),
                }
            })
            .collect()
    }

    #[test]
    fn canaries_then_each_wave_once_the_one_before_was_healthy_for_the_wait() {
        let mut rollout = Rollout::new(plan(2, &[50, 100], 20), 0);
        let mut kept: Vec<String> = Vec::new();
        let sent = rollout.step(&fleet(10, &kept), None, 0);
        assert_eq!(sent, ["n-00", "n-01"], "the canaries");
        assert!(
            rollout.step(&fleet(10, &kept), None, 10).is_empty(),
            "they have not reported"
        );
        kept.extend(sent);
        assert!(
            rollout.step(&fleet(10, &kept), None, 20).is_empty(),
            "healthy, but not for the wait yet"
        );
        let sent = rollout.step(&fleet(10, &kept), None, 1_100);
        assert_eq!(rollout.stage, 1);
        assert_eq!(sent.len(), 3, "50% of 10 in all: 3 more");
        kept.extend(sent);
        rollout.step(&fleet(10, &kept), None, 1_200);
        let sent = rollout.step(&fleet(10, &kept), None, 2_300);
        assert_eq!((rollout.stage, sent.len()), (2, 5));
        kept.extend(sent);
        rollout.step(&fleet(10, &kept), None, 2_400);
        rollout.step(&fleet(10, &kept), None, 3_500);
        assert_eq!(rollout.state, RolloutState::Done);
        // A machine that joins later gets it too.
        let sent = rollout.step(&fleet(11, &kept), None, 3_600);
        assert_eq!(sent, ["n-10"]);
    }

    #[test]
    fn a_failed_canary_past_the_share_halts_and_no_machine_beyond_is_touched() {
        let mut rollout = Rollout::new(plan(5, &[100], 5), 0);
        let sent = rollout.step(&fleet(20, &[]), None, 0);
        assert_eq!(sent.len(), 5);
        let mut nodes = fleet(20, &sent[1..]);
        nodes[0] = node(
            0,
            Some(UpdateOutcome::Reverted {
                from: 5,
                to: 7,
                reason: "the new agent exited during its trial".into(),
            }),
            5,
        );
        assert!(rollout.step(&nodes, None, 10).is_empty());
        let RolloutState::Halted { reason } = &rollout.state else {
            panic!("{:?}", rollout.state);
        };
        assert_eq!(
            reason,
            "1 of 5 machines of the canaries failed (20%, above the 5% allowed); n-00: reverted: the new agent exited during its trial"
        );
        assert!(
            rollout.step(&nodes, None, 1_000_000).is_empty(),
            "halted: nothing more is sent"
        );
        assert_eq!(rollout.machines.len(), 5);
    }

    #[test]
    fn drained_machines_and_those_without_a_session_wait() {
        let mut rollout = Rollout::new(plan(3, &[100], 50), 0);
        let mut nodes = fleet(4, &[]);
        nodes[0].drain = Some(crate::nodes::Drain::Drained);
        nodes[1].state = NodeState::Lost;
        nodes[2].protocol = Some(NodeProtocol::Speaks {
            version: ProtocolVersion(1),
        });
        assert_eq!(rollout.step(&nodes, None, 0), ["n-03"]);
        nodes[0].drain = None;
        assert_eq!(
            rollout.step(&nodes, None, 1),
            ["n-00"],
            "undrained, it takes it"
        );
    }

    #[test]
    fn a_rollout_is_done_when_no_machine_that_can_take_it_is_left_and_the_rest_get_it_later() {
        let mut rollout = Rollout::new(plan(1, &[100], 50), 0);
        let mut nodes = fleet(3, &[]);
        nodes[0].drain = Some(crate::nodes::Drain::Drained);
        assert_eq!(rollout.step(&nodes, None, 0), ["n-01"], "the canary");
        let mut kept = fleet(3, &["n-01".to_string()]);
        kept[0].drain = Some(crate::nodes::Drain::Drained);
        rollout.step(&kept, None, 10);
        assert_eq!(rollout.step(&kept, None, 1_100), ["n-02"], "the wave");
        let mut kept = fleet(3, &["n-01".to_string(), "n-02".to_string()]);
        kept[0].drain = Some(crate::nodes::Drain::Drained);
        rollout.step(&kept, None, 1_200);
        assert!(rollout.step(&kept, None, 2_300).is_empty());
        assert_eq!(
            rollout.state,
            RolloutState::Done,
            "the drained machine does not hold it up"
        );
        kept[0].drain = None;
        assert_eq!(
            rollout.step(&kept, None, 2_400),
            ["n-00"],
            "undrained, it gets it"
        );
    }
}
