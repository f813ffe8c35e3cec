//! The rules every backend must keep, one check per rule. A backend passes when
//! [`run_all`] passes with a factory that hands out a fresh, blank backend per call:
//!
//! ```text
//! fleet_coordinator::store::conformance::run_all(&|| Box::new(MyBackend::blank()));
//! ```
//!
//! The checks panic on the first broken rule, naming it.
use super::{
    Applied, Backend, Beat, BootstrapFailure, Change, EndOutcome, Ending, ForgetOutcome,
    KEEP_FINAL_RUNS, NodeBrief, NodeEvent, Redeemed, RunRow, SCHEMA_VERSION, Store, StoreError,
    StoreResult, TokenRecord,
};
use fleet_proto::protocol::NodeEnd;
use fleet_proto::run::{Event, RunOptions, RunReport, RunState, Workload};

use fleet_proto::{Digest, NodeId, RunId};

fn rid(id: &str) -> RunId {
    RunId::parse(id).expect("a test's run id is valid")
}

fn nid(id: &str) -> NodeId {
    NodeId::new(id)
}

/// Hands out a fresh, blank backend per call.
pub type Blank<'a> = &'a dyn Fn() -> Box<dyn Backend>;

/// One rule's check.
pub type Rule = fn(Blank);

/// Every rule, by name.
pub const RULES: &[(&str, Rule)] = &[
    ("token_spent_once", token_spent_once),
    (
        "expired_token_refused_and_pruned_at_next_mint",
        expired_token_refused_and_pruned_at_next_mint,
    ),
    (
        "failed_bootstrap_recorded_once_and_burns_its_token",
        failed_bootstrap_recorded_once_and_burns_its_token,
    ),
    ("sessions_and_heartbeats", sessions_and_heartbeats),
    ("events_deduped_by_id", events_deduped_by_id),
    ("states_move_only_forward", states_move_only_forward),
    ("unreadable_event_refused", unreadable_event_refused),
    (
        "events_of_another_node_ignored",
        events_of_another_node_ignored,
    ),
    (
        "accept_with_error_fails_waiting_run",
        accept_with_error_fails_waiting_run,
    ),
    (
        "waiting_runs_for_one_node_oldest_first",
        waiting_runs_for_one_node_oldest_first,
    ),
    (
        "fail_run_ends_only_active_runs",
        fail_run_ends_only_active_runs,
    ),
    (
        "a_lost_verdict_spares_a_node_heard_since",
        a_lost_verdict_spares_a_node_heard_since,
    ),
    (
        "create_set_checks_its_runs_and_programs",
        create_set_checks_its_runs_and_programs,
    ),
    (
        "retention_prunes_oldest_run_set_and_program",
        retention_prunes_oldest_run_set_and_program,
    ),
    (
        "schema_version_mismatch_refused",
        schema_version_mismatch_refused,
    ),
    ("retention_is_per_node", retention_is_per_node),
    (
        "waiting_index_follows_the_runs",
        waiting_index_follows_the_runs,
    ),
    (
        "changes_applied_together_each_answered",
        changes_applied_together_each_answered,
    ),
    (
        "one_nodes_changes_in_one_batch_read_each_others_writes",
        one_nodes_changes_in_one_batch_read_each_others_writes,
    ),
    (
        "a_drain_is_kept_and_refuses_new_runs",
        a_drain_is_kept_and_refuses_new_runs,
    ),
    (
        "a_capacity_is_kept_and_runs_go_out_in_order",
        a_capacity_is_kept_and_runs_go_out_in_order,
    ),
    (
        "ending_a_node_loses_its_runs_and_forget_removes_it",
        ending_a_node_loses_its_runs_and_forget_removes_it,
    ),
    (
        "a_lost_run_with_retries_is_placed_again_once",
        a_lost_run_with_retries_is_placed_again_once,
    ),
    ("the_first_key_is_the_fleets", the_first_key_is_the_fleets),
    (
        "releases_only_go_up_and_their_binaries_are_kept",
        releases_only_go_up_and_their_binaries_are_kept,
    ),
    (
        "runs_queued_for_a_match_go_to_distinct_matching_nodes",
        runs_queued_for_a_match_go_to_distinct_matching_nodes,
    ),
];

/// Runs every rule against fresh backends from `blank`.
pub fn run_all(blank: Blank) {
    for (name, rule) in RULES {
        eprintln!("store conformance: {name}");
        rule(blank);
    }
}

const KEY_A: &str = "ed25519:key-a";
const KEY_B: &str = "ed25519:key-b";
const KEY_C: &str = "ed25519:key-c";
const NODE_A: &str = "n-a";
const NODE_B: &str = "n-b";
const NODE_C: &str = "n-c";

fn open(blank: Blank, keep: u64) -> Store {
    Store::open(blank(), keep).expect("a blank backend opens as a store")
}

/// An unspent token of a named node, expiring at `expires_at_ms`.
pub fn token(expires_at_ms: u64) -> TokenRecord {
    TokenRecord {
        expires_at_ms,
        name: Some("worker".into()),
        labels: [("zone".to_string(), "a".to_string())].into(),
        spent_by: None,
        bootstrap_failure: None,
    }
}

/// Joins a node the way a machine does: a token minted, then redeemed by the node's key.
fn join(store: &Store, node_id: &str, key: &str) {
    let hash = format!("hash-of-{node_id}");
    store.add_token(&hash, &token(u64::MAX), 0).unwrap();
    let redeemed = store.redeem(&hash, key, &nid(node_id), 1, 1_000).unwrap();
    assert!(redeemed.is_some_and(|r| r.first), "{node_id} joins");
}

fn digest(program: &[u8]) -> Digest {
    Digest::of_reader(program).expect("hashing a slice")
}

/// A new waiting run of `program`, as `create_set` takes it.
pub fn run(id: &str, set_id: &str, node_id: &str, program: &[u8], created_ms: u64) -> RunRow {
    RunRow {
        id: rid(id),
        set_id: set_id.into(),
        position: 0,
        node_id: node_id.into(),
        state: RunState::Waiting,
        workload: Workload::Program(digest(program)),
        needs_registry_auth: false,
        options: RunOptions::default(),
        created_ms,
        updated_ms: created_ms,
        accepted: false,
        report: None,
        error: None,
        events: Vec::new(),
        raw_command: None,
        signed_by: None,
        retry: None,
        attempt: 1,
        previous: None,
        retried_as: None,
        queued_for: None,
    }
}

/// Records a set of `runs`.
/// A node joined and in a session whose lease lasts past the test.
fn join_live(store: &Store, node_id: &str, key: &str) {
    join(store, node_id, key);
    store.open_session(&nid(node_id), u64::MAX / 2).unwrap();
}

fn create(store: &Store, set_id: &str, runs: &[RunRow]) {
    store.create_set(&set_id.into(), runs).unwrap();
}

/// How many references stored runs hold on the content.
fn refs(store: &Store, digest: &str) -> u64 {
    let digest = fleet_proto::Digest::parse(digest).unwrap();
    store.read(|tx| tx.program_refs(&digest)).unwrap()
}

/// A node's facts: `cpus` cores, as many runs at once.
fn facts(arch: &str, cpus: usize) -> fleet_proto::facts::Facts {
    fleet_proto::facts::Facts {
        arch: arch.into(),
        cpus,
        memory_bytes: 1 << 30,
        disk_free_bytes: 1 << 30,
        kernel: "6.1".into(),
        os: "debian".into(),
        agent_version: "test".into(),
        accelerators: Vec::new(),
        max_runs: Some(cpus as u32),
        measured_link: None,
        release: None,
        engine: None,
        content: None,
    }
}

fn event(id: u64, run_id: &str, state: RunState) -> NodeEvent {
    let report = match state {
        RunState::Failed => RunReport::error("it broke"),
        _ => RunReport::default(),
    };
    NodeEvent::Known(Event {
        id,
        run_id: rid(run_id),
        state,
        report,
        at_unix_ms: 100 + id,
    })
}

fn state_of(store: &Store, id: &str) -> RunState {
    store
        .run(&rid(id))
        .unwrap()
        .expect("the run is stored")
        .state
}

fn active_ids(store: &Store) -> Vec<RunId> {
    let mut ids: Vec<RunId> = store
        .active_runs()
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect();
    ids.sort();
    ids
}

fn final_count(store: &Store) -> u64 {
    store.read(|tx| tx.final_count(&nid(NODE_A))).unwrap()
}

/// A token is spent once: a second key is refused, the same key is answered again (its answer
/// may have been lost) until the token expires.
pub fn token_spent_once(blank: Blank) {
    let store = open(blank, KEEP_FINAL_RUNS);
    store.add_token("t", &token(1_000), 0).unwrap();
    assert!(
        store.has_waiting_token(10).unwrap(),
        "an unspent token waits"
    );
    let Some(Redeemed { node, first }) = store.redeem("t", KEY_A, &nid(NODE_A), 10, 500).unwrap()
    else {
        panic!("a fresh token is redeemed");
    };
    assert!(first);
    assert_eq!(
        (node.id.as_str(), node.public_key.as_str()),
        (NODE_A, KEY_A)
    );
    assert_eq!(node.name.as_deref(), Some("worker"), "the token's name");
    assert_eq!(node.labels.get("zone").map(String::as_str), Some("a"));
    assert_eq!((node.joined_at_ms, node.lease_until_ms), (10, 500));
    assert!(
        !store.has_waiting_token(10).unwrap(),
        "a spent token waits no more"
    );
    assert!(
        store
            .redeem("t", KEY_B, &nid(NODE_B), 20, 500)
            .unwrap()
            .is_none(),
        "another key is refused"
    );
    assert!(store.node(&nid(NODE_B)).unwrap().is_none());
    let again = store.redeem("t", KEY_A, &nid(NODE_A), 30, 500).unwrap();
    assert!(
        again.is_some_and(|r| !r.first && r.node.id == nid(NODE_A)),
        "the same key is answered again"
    );
    assert!(
        store
            .redeem("unknown", KEY_A, &nid(NODE_A), 30, 500)
            .unwrap()
            .is_none(),
        "an unknown token is refused"
    );
    assert_eq!(store.nodes().unwrap().len(), 1);
}

/// A machine's failed bootstrap is recorded on its waiting token, once, with its reason; the token
/// is burnt (no longer waiting, never redeemed). An unknown, spent or expired token takes no report.
pub fn failed_bootstrap_recorded_once_and_burns_its_token(blank: Blank) {
    let store = open(blank, KEEP_FINAL_RUNS);
    store.add_token("t", &token(1_000), 0).unwrap();
    store.add_token("spent", &token(1_000), 0).unwrap();
    assert!(
        store
            .redeem("spent", KEY_B, &nid(NODE_B), 5, 500)
            .unwrap()
            .is_some()
    );
    assert!(store.fail_bootstrap("t", "bundle mismatch", 10).unwrap());
    assert!(
        !store.fail_bootstrap("t", "again", 11).unwrap(),
        "a failure is recorded once"
    );
    let failed = store.failed_bootstraps().unwrap();
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(failed[0].0, "t");
    assert_eq!(
        failed[0].1.bootstrap_failure,
        Some(BootstrapFailure {
            at_ms: 10,
            reason: "bundle mismatch".into()
        }),
        "the first reason, at the coordinator's clock"
    );
    assert!(
        !store.has_waiting_token(20).unwrap(),
        "a failed token waits no more"
    );
    assert!(
        store
            .redeem("t", KEY_A, &nid(NODE_A), 20, 500)
            .unwrap()
            .is_none(),
        "a failed token is never redeemed"
    );
    assert!(!store.fail_bootstrap("unknown", "x", 20).unwrap());
    assert!(
        !store.fail_bootstrap("spent", "x", 20).unwrap(),
        "a spent token takes no report"
    );
    store.add_token("late", &token(100), 0).unwrap();
    assert!(
        !store.fail_bootstrap("late", "x", 100).unwrap(),
        "an expired token takes no report"
    );
    assert_eq!(store.failed_bootstraps().unwrap().len(), 1);
}

/// An expired token is refused; the next mint prunes every expired token (by the clock it is
/// given), spent or not, and keeps a spent token until it expires.
pub fn expired_token_refused_and_pruned_at_next_mint(blank: Blank) {
    let store = open(blank, KEEP_FINAL_RUNS);
    store.add_token("spent", &token(1_000), 0).unwrap();
    store.add_token("short", &token(100), 0).unwrap();
    assert!(
        store
            .redeem("spent", KEY_A, &nid(NODE_A), 10, 50)
            .unwrap()
            .is_some()
    );
    assert!(store.has_waiting_token(99).unwrap());
    assert!(
        !store.has_waiting_token(100).unwrap(),
        "expired at its expiry"
    );
    assert!(
        store
            .redeem("short", KEY_B, &nid(NODE_B), 100, 500)
            .unwrap()
            .is_none(),
        "an expired token is refused"
    );
    store.add_token("next", &token(2_000), 200).unwrap();
    let hashes = |store: &Store| {
        let mut hashes: Vec<String> = store
            .read(|tx| tx.tokens())
            .unwrap()
            .into_iter()
            .map(|(h, _)| h)
            .collect();
        hashes.sort();
        hashes
    };
    assert_eq!(
        hashes(&store),
        ["next", "spent"],
        "the expired token is pruned at the next mint, the spent one kept"
    );
    assert!(
        store
            .redeem("spent", KEY_A, &nid(NODE_A), 300, 500)
            .unwrap()
            .is_some_and(|r| !r.first),
        "a spent, unexpired token still answers its key"
    );
    store.add_token("later", &token(5_000), 1_000).unwrap();
    assert_eq!(
        hashes(&store),
        ["later", "next"],
        "a spent token is pruned once expired"
    );
}

/// A session raises the generation; a heartbeat extends the lease and keeps the last facts.
pub fn sessions_and_heartbeats(blank: Blank) {
    let store = open(blank, KEEP_FINAL_RUNS);
    join(&store, NODE_A, KEY_A);
    assert_eq!(store.open_session(&nid(NODE_A), 2_000).unwrap(), 1);
    assert_eq!(store.open_session(&nid(NODE_A), 3_000).unwrap(), 2);
    store.heartbeat(&nid(NODE_A), 2_500, 4_000, None).unwrap();
    let node = store.node(&nid(NODE_A)).unwrap().unwrap();
    assert_eq!(
        (node.generation, node.last_heartbeat_ms, node.lease_until_ms),
        (2, Some(2_500), 4_000)
    );
    assert!(node.facts.is_none());
    assert!(
        store.open_session(&nid("n-unknown"), 1).is_err(),
        "a session for a node that never joined"
    );
    join(&store, NODE_B, KEY_B);
    let facts = facts("x86_64", 2);
    store
        .heartbeat(&nid(NODE_A), 2_600, 4_100, Some(facts.clone()))
        .unwrap();
    store.heartbeat(&nid(NODE_A), 2_700, 4_200, None).unwrap();
    let node = store.node(&nid(NODE_A)).unwrap().unwrap();
    assert_eq!(
        (node.last_heartbeat_ms, node.lease_until_ms),
        (Some(2_700), 4_200)
    );
    assert_eq!(node.facts, Some(facts), "a heartbeat keeps the last facts");
    assert_eq!(node.generation, 2, "a heartbeat keeps the generation");
    let listed = store.nodes().unwrap();
    let a = listed.iter().find(|n| n.id == nid(NODE_A)).expect("listed");
    assert_eq!(
        (a.last_heartbeat_ms, a.lease_until_ms),
        (Some(2_700), 4_200)
    );
    let b = store.node(&nid(NODE_B)).unwrap().unwrap();
    assert_eq!(
        (b.last_heartbeat_ms, b.lease_until_ms),
        (None, 1_000),
        "another node's lease is its own"
    );
}

/// Events are stored once per node and id; the answer is the highest id stored.
pub fn events_deduped_by_id(blank: Blank) {
    let store = open(blank, KEEP_FINAL_RUNS);
    join(&store, NODE_A, KEY_A);
    create(&store, "s1", &[run("r1", "s1", NODE_A, b"p", 1)]);
    let up_to = store
        .apply_events(&nid(NODE_A), &[event(1, "r1", RunState::Starting)])
        .unwrap();
    assert_eq!(up_to, 1);
    let up_to = store
        .apply_events(
            &nid(NODE_A),
            &[
                event(1, "r1", RunState::Starting),
                event(2, "r1", RunState::Running),
            ],
        )
        .unwrap();
    assert_eq!(up_to, 2);
    let up_to = store
        .apply_events(&nid(NODE_A), &[event(2, "r1", RunState::Running)])
        .unwrap();
    assert_eq!(up_to, 2, "a batch of duplicates answers the same");
    let row = store.run(&rid("r1")).unwrap().unwrap();
    let ids: Vec<u64> = row.events.iter().map(|e| e.id).collect();
    assert_eq!(ids, [1, 2], "each event stored once");
    assert_eq!(row.state, RunState::Running);
    assert_eq!(store.node(&nid(NODE_A)).unwrap().unwrap().last_event_id, 2);
}

/// States only move forward: an event for an earlier state, or any after a final one, is stored
/// and changes nothing; the final run leaves the active runs once.
pub fn states_move_only_forward(blank: Blank) {
    let store = open(blank, KEEP_FINAL_RUNS);
    join(&store, NODE_A, KEY_A);
    create(&store, "s1", &[run("r1", "s1", NODE_A, b"p", 1)]);
    store
        .apply_events(
            &nid(NODE_A),
            &[
                event(1, "r1", RunState::Running),
                event(2, "r1", RunState::Starting),
            ],
        )
        .unwrap();
    assert_eq!(state_of(&store, "r1"), RunState::Running, "never backward");
    store
        .apply_events(&nid(NODE_A), &[event(3, "r1", RunState::Failed)])
        .unwrap();
    let failed = store.run(&rid("r1")).unwrap().unwrap();
    assert_eq!(failed.state, RunState::Failed);
    assert_eq!(
        failed.error.as_deref(),
        Some("it broke"),
        "the report's error"
    );
    assert!(failed.report.is_some());
    assert!(
        active_ids(&store).is_empty(),
        "a final run is no longer active"
    );
    store
        .apply_events(
            &nid(NODE_A),
            &[
                event(4, "r1", RunState::Running),
                event(5, "r1", RunState::Finished),
            ],
        )
        .unwrap();
    let row = store.run(&rid("r1")).unwrap().unwrap();
    assert_eq!(row.state, RunState::Failed, "nothing follows a final state");
    assert_eq!(row.events.len(), 5, "every event is still recorded");
    assert_eq!(final_count(&store), 1, "retired once");
}

/// An event this coordinator cannot read is stored as refused, with its reason, and changes
/// nothing else on the run; its id still counts as stored.
pub fn unreadable_event_refused(blank: Blank) {
    let store = open(blank, KEEP_FINAL_RUNS);
    join(&store, NODE_A, KEY_A);
    create(&store, "s1", &[run("r1", "s1", NODE_A, b"p", 1)]);
    let unreadable = NodeEvent::Unreadable {
        id: 1,
        run_id: rid("r1"),
        at_ms: 50,
        reason: "unknown state `paused`".into(),
    };
    assert_eq!(store.apply_events(&nid(NODE_A), &[unreadable]).unwrap(), 1);
    let row = store.run(&rid("r1")).unwrap().unwrap();
    assert_eq!(row.state, RunState::Waiting, "the run is unchanged");
    assert!(row.report.is_none() && row.error.is_none());
    assert_eq!(row.events.len(), 1);
    let stored = &row.events[0];
    assert_eq!((stored.id, stored.state, stored.at_ms), (1, None, 50));
    assert_eq!(stored.refused.as_deref(), Some("unknown state `paused`"));
    assert_eq!(active_ids(&store), ["r1"]);
}

/// A node's events about a run of another node (or an unknown run) change nothing, but count as
/// stored.
pub fn events_of_another_node_ignored(blank: Blank) {
    let store = open(blank, KEEP_FINAL_RUNS);
    join(&store, NODE_A, KEY_A);
    join(&store, NODE_B, KEY_B);
    create(&store, "s1", &[run("r1", "s1", NODE_A, b"p", 1)]);
    let up_to = store
        .apply_events(
            &nid(NODE_B),
            &[
                event(7, "r1", RunState::Finished),
                event(8, "r-unknown", RunState::Running),
            ],
        )
        .unwrap();
    assert_eq!(up_to, 8);
    let row = store.run(&rid("r1")).unwrap().unwrap();
    assert_eq!(row.state, RunState::Waiting);
    assert!(row.events.is_empty());
    assert_eq!(
        store.node(&nid(NODE_A)).unwrap().unwrap().last_event_id,
        0,
        "ids are counted per node"
    );
    assert!(
        store.apply_events(&nid("n-unknown"), &[]).is_err(),
        "events from a node that never joined"
    );
}

/// Answers to starts: each run becomes the node's; an error fails a waiting run, never a final
/// one.
pub fn accept_with_error_fails_waiting_run(blank: Blank) {
    let store = open(blank, KEEP_FINAL_RUNS);
    join(&store, NODE_A, KEY_A);
    create(
        &store,
        "s1",
        &[
            run("r1", "s1", NODE_A, b"p", 1),
            run("r2", "s1", NODE_A, b"p", 2),
            run("r3", "s1", NODE_A, b"p", 3),
        ],
    );
    store
        .apply_events(&nid(NODE_A), &[event(1, "r3", RunState::Finished)])
        .unwrap();
    store
        .accept_runs(&[
            (rid("r1"), None),
            (rid("r2"), Some("no such program".into())),
            (rid("r3"), Some("late refusal".into())),
            (rid("r-unknown"), None),
        ])
        .unwrap();
    let r1 = store.run(&rid("r1")).unwrap().unwrap();
    assert!(r1.accepted && r1.state == RunState::Waiting && r1.error.is_none());
    let r2 = store.run(&rid("r2")).unwrap().unwrap();
    assert!(r2.accepted);
    assert_eq!(r2.state, RunState::Failed, "an error answer fails the run");
    assert_eq!(r2.error.as_deref(), Some("no such program"));
    let r3 = store.run(&rid("r3")).unwrap().unwrap();
    assert_eq!(r3.state, RunState::Finished, "a final run stays as it is");
    assert!(r3.error.is_none());
    assert_eq!(active_ids(&store), ["r1"]);
    assert_eq!(final_count(&store), 2);
    assert!(store.waiting_runs(&nid(NODE_A)).unwrap().is_empty());
}

/// The runs waiting for a node: its own, not accepted yet, not final, oldest first (among runs
/// created at the same time, by set, then in the set's order).
pub fn waiting_runs_for_one_node_oldest_first(blank: Blank) {
    let store = open(blank, KEEP_FINAL_RUNS);
    join(&store, NODE_A, KEY_A);
    join(&store, NODE_B, KEY_B);
    create(
        &store,
        "s1",
        &[
            run("r-a", "s1", NODE_A, b"p", 30),
            run("r-b", "s1", NODE_A, b"p", 10),
            run("r-c", "s1", NODE_A, b"p", 20),
            run("r-d", "s1", NODE_A, b"p", 5),
            run("r-e", "s1", NODE_B, b"p", 1),
        ],
    );
    create(
        &store,
        "s2",
        &[
            run("r-f", "s2", NODE_A, b"q", 15),
            run("r-aa", "s2", NODE_A, b"q", 10),
        ],
    );
    store.accept_runs(&[(rid("r-c"), None)]).unwrap();
    store
        .fail_run(&rid("r-d"), RunState::Failed, "swept")
        .unwrap();
    let ids = |node: &str| -> Vec<RunId> {
        store
            .waiting_runs(&nid(node))
            .unwrap()
            .into_iter()
            .map(|r| r.id)
            .collect()
    };
    assert_eq!(
        ids(NODE_A),
        ["r-b", "r-aa", "r-f", "r-a"],
        "by age, then by set"
    );
    assert_eq!(ids(NODE_B), ["r-e"]);
    assert!(ids("n-other").is_empty());
}

/// The sweep's `lost` verdict, judged at a moment the node's lease had passed, is given only if
/// the lease has not been renewed past that moment since.
pub fn a_lost_verdict_spares_a_node_heard_since(blank: Blank) {
    let store = open(blank, KEEP_FINAL_RUNS);
    join(&store, NODE_A, KEY_A);
    create(&store, "s1", &[run("r1", "s1", NODE_A, b"p", 1)]);
    store
        .apply_events(&nid(NODE_A), &[event(1, "r1", RunState::Running)])
        .unwrap();
    // The join leased the node until 1 000: judged at 500, it has been heard since.
    let spared = store.lose_run(&rid("r1"), "node gone", 500).unwrap();
    assert!(spared.is_some_and(|r| r.state == RunState::Running));
    let lost = store.lose_run(&rid("r1"), "node gone", 1_000).unwrap();
    assert!(
        lost.is_some_and(|r| r.state == RunState::Lost && r.error.as_deref() == Some("node gone"))
    );
    assert!(store.lose_run(&rid("r-unknown"), "x", 0).unwrap().is_none());
}

/// The sweep's verdict ends a run not yet final (failed or lost, with its reason), and leaves a
/// final run as it is.
pub fn fail_run_ends_only_active_runs(blank: Blank) {
    let store = open(blank, KEEP_FINAL_RUNS);
    join(&store, NODE_A, KEY_A);
    create(
        &store,
        "s1",
        &[
            run("r1", "s1", NODE_A, b"p", 1),
            run("r2", "s1", NODE_A, b"p", 2),
        ],
    );
    store
        .apply_events(&nid(NODE_A), &[event(1, "r2", RunState::Running)])
        .unwrap();
    let lost = store
        .fail_run(&rid("r2"), RunState::Lost, "node gone")
        .unwrap();
    assert!(
        lost.is_some_and(|r| r.state == RunState::Lost && r.error.as_deref() == Some("node gone"))
    );
    let again = store
        .fail_run(&rid("r2"), RunState::Failed, "late")
        .unwrap()
        .unwrap();
    assert_eq!(again.state, RunState::Lost, "a final run stays as it is");
    assert_eq!(again.error.as_deref(), Some("node gone"));
    assert!(
        store
            .fail_run(&rid("r-unknown"), RunState::Failed, "x")
            .unwrap()
            .is_none()
    );
    assert!(
        matches!(
            store.fail_run(&rid("r1"), RunState::Running, "x"),
            Err(StoreError::Refused(_))
        ),
        "a run is failed only as failed or lost"
    );
    assert_eq!(state_of(&store, "r1"), RunState::Waiting);
    assert_eq!(active_ids(&store), ["r1"]);
    assert_eq!(final_count(&store), 1);
}

/// A set is recorded whole or not at all, as new waiting runs of that set; each run holds a
/// reference on each content it names (program and inputs), counted by digest.
pub fn create_set_checks_its_runs_and_programs(blank: Blank) {
    let store = open(blank, KEEP_FINAL_RUNS);
    join(&store, NODE_A, KEY_A);
    let p = digest(b"p").to_string();
    let refused = |result| matches!(result, Err(StoreError::Refused(_)));
    assert!(refused(store.create_set(&"s0".into(), &[])), "no runs");
    assert!(
        refused(store.create_set(&"s0".into(), &[run("r0", "s9", NODE_A, b"p", 1)])),
        "a run of another set"
    );
    let mut accepted = run("r0", "s0", NODE_A, b"p", 1);
    accepted.accepted = true;
    assert!(refused(store.create_set(&"s0".into(), &[accepted])));
    assert!(
        store.set_runs(&"s0".into()).unwrap().is_none(),
        "nothing recorded"
    );
    assert_eq!(refs(&store, &p), 0, "nothing recorded");
    create(&store, "s1", &[run("r1", "s1", NODE_A, b"p", 1)]);
    assert_eq!(refs(&store, &p), 1);
    let mut with_input = run("r2", "s2", NODE_A, b"p", 2);
    let input = digest(b"i");
    with_input.options.inputs = vec![("data".into(), input)];
    store.create_set(&"s2".into(), &[with_input]).unwrap();
    assert_eq!(
        refs(&store, &input.to_string()),
        1,
        "an input is referenced too"
    );
    assert!(
        refused(store.create_set(&"s2".into(), &[run("r3", "s2", NODE_A, b"p", 3)])),
        "an existing set"
    );
    // A run there before (r1), or named twice in the set (r5), after a new one.
    for (first, second, named) in [("r4", "r1", "r1"), ("r5", "r5", "r5")] {
        let set = [
            run(first, "s3", NODE_A, b"p", 3),
            run(second, "s3", NODE_A, b"p", 4),
        ];
        match store.create_set(&"s3".into(), &set) {
            Err(StoreError::Refused(why)) => {
                assert_eq!(why, format!("the run {named} exists already"))
            }
            other => panic!("a run there already must be refused, not {other:?}"),
        }
    }
    assert!(store.run(&rid("r4")).unwrap().is_none(), "nothing recorded");
    assert!(store.run(&rid("r5")).unwrap().is_none(), "nothing recorded");
    let s1: Vec<RunId> = store
        .set_runs(&"s1".into())
        .unwrap()
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(s1, ["r1"]);
    assert_eq!(active_ids(&store), ["r1", "r2"]);
    assert_eq!(refs(&store, &p), 2);
    // More than one PostgreSQL statement's worth (1 000 rows): a run named twice far apart is
    // still refused with nothing recorded, and the set without it is recorded whole, in order.
    let big: Vec<RunRow> = (0..2500u64)
        .map(|i| run(&format!("b{i}"), "s4", NODE_A, b"p", 10 + i))
        .collect();
    let mut twice = big.clone();
    twice[2100] = run("b7", "s4", NODE_A, b"p", 5000);
    match store.create_set(&"s4".into(), &twice) {
        Err(StoreError::Refused(why)) => assert_eq!(why, "the run b7 exists already"),
        other => panic!("a run named twice must be refused, not {other:?}"),
    }
    assert!(store.run(&rid("b0")).unwrap().is_none(), "nothing recorded");
    create(&store, "s4", &big);
    let s4 = store.set_runs(&"s4".into()).unwrap().unwrap();
    assert!(s4.iter().map(|r| &r.id).eq(big.iter().map(|r| &r.id)));
    assert_eq!(active_ids(&store).len(), 2502);
    assert_eq!(refs(&store, &p), 2502);
}

/// Retention keeps the newest `keep` final runs: beyond it the oldest is pruned, its set once
/// it has no runs left, its program once no stored run refers to it; a program an active or kept
/// run uses stays.
pub fn retention_prunes_oldest_run_set_and_program(blank: Blank) {
    let store = open(blank, 2);
    assert_eq!(store.keep_final_runs(), 2);
    join(&store, NODE_A, KEY_A);
    let (p1, p2, p3) = (
        digest(b"p1").to_string(),
        digest(b"p2").to_string(),
        digest(b"p3").to_string(),
    );
    create(&store, "s1", &[run("r1", "s1", NODE_A, b"p1", 1)]);
    create(
        &store,
        "s2",
        &[
            run("r2", "s2", NODE_A, b"p2", 2),
            run("r3", "s2", NODE_A, b"p2", 3),
        ],
    );
    create(
        &store,
        "s3",
        &[
            run("r4", "s3", NODE_A, b"p3", 4),
            run("r5", "s3", NODE_A, b"p3", 5),
        ],
    );
    let finish = |id: &str, event_id: u64| {
        store
            .apply_events(&nid(NODE_A), &[event(event_id, id, RunState::Finished)])
            .unwrap();
    };
    finish("r1", 1);
    finish("r2", 2);
    assert!(
        store.run(&rid("r1")).unwrap().is_some(),
        "at the limit, all kept"
    );
    assert_eq!(final_count(&store), 2);

    finish("r4", 3);
    assert!(
        store.run(&rid("r1")).unwrap().is_none(),
        "the oldest final run is pruned"
    );
    assert!(
        store.set_runs(&"s1".into()).unwrap().is_none(),
        "its set, now empty, too"
    );
    assert!(refs(&store, &p1) == 0, "its program, now unused, too");
    assert_eq!(final_count(&store), 2);

    store
        .fail_run(&rid("r3"), RunState::Failed, "swept")
        .unwrap();
    assert!(store.run(&rid("r2")).unwrap().is_none());
    let s2: Vec<RunId> = store
        .set_runs(&"s2".into())
        .unwrap()
        .expect("a set with a kept run stays")
        .into_iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(s2, ["r3"]);
    assert!(refs(&store, &p2) > 0, "a program a kept run uses stays");

    finish("r5", 4);
    assert!(store.run(&rid("r4")).unwrap().is_none());
    assert_eq!(
        store.set_runs(&"s3".into()).unwrap().map(|runs| runs.len()),
        Some(1)
    );
    assert!(refs(&store, &p3) > 0, "r5 still uses p3");
    assert_eq!(final_count(&store), 2);

    // A program an active run still uses outlives every final run that used it.
    create(
        &store,
        "s4",
        &[
            run("r6", "s4", NODE_A, b"p1", 6),
            run("r7", "s4", NODE_A, b"p1", 7),
        ],
    );
    finish("r6", 5);
    store
        .fail_run(&rid("r3"), RunState::Failed, "again")
        .unwrap();
    assert!(
        store.set_runs(&"s2".into()).unwrap().is_none(),
        "s2 pruned with r3"
    );
    assert!(refs(&store, &p2) == 0, "p2 pruned with r3");
    create(
        &store,
        "s5",
        &[
            run("r8", "s5", NODE_A, b"p2", 8),
            run("r9", "s5", NODE_A, b"p2", 9),
        ],
    );
    store.fail_run(&rid("r8"), RunState::Lost, "gone").unwrap();
    store.fail_run(&rid("r9"), RunState::Lost, "gone").unwrap();
    assert!(store.run(&rid("r6")).unwrap().is_none(), "r6 pruned");
    assert!(refs(&store, &p1) > 0, "r7 (waiting) still uses p1");
    assert_eq!(active_ids(&store), ["r7"]);
    assert_eq!(refs(&store, &p1), 1);
    assert!(refs(&store, &p3) == 0, "r5 pruned with p3's last use");
    assert!(store.set_runs(&"s3".into()).unwrap().is_none());
    // What the copy sweep keeps: the content stored runs still refer to, and only that.
    let mut referenced: Vec<String> = (store.referenced_content().unwrap().iter())
        .map(|d| d.to_string())
        .collect();
    referenced.sort();
    let mut expected: Vec<String> = [&p1, &p2, &p3]
        .into_iter()
        .filter(|p| refs(&store, p) > 0)
        .cloned()
        .collect();
    expected.sort();
    assert_eq!(referenced, expected);
    assert!(referenced.contains(&p1));
}

fn release(sequence: u64, binary: &[u8]) -> super::ReleaseRecord {
    let manifest = fleet_proto::release::ReleaseManifest {
        version: format!("0.{sequence}.0"),
        sequence,
        min_sequence: 0,
        expires_at_ms: u64::MAX,
        binaries: vec![fleet_proto::release::ReleaseBinary {
            target: "x86_64-unknown-linux-musl".into(),
            name: "fleet-agent".into(),
            sha256: digest(binary),
            size: binary.len() as u64,
        }],
        roots: vec![],
        revoked_keys: vec![],
    };
    super::ReleaseRecord {
        manifest: format!("manifest-{sequence}"),
        signature: fleet_proto::release::ReleaseSignature {
            certified: fleet_proto::release::CertifiedKey {
                certificate: "c".into(),
                certificate_signature: "s".into(),
            },
            signature: "s".into(),
        },
        manifest_read: manifest,
        added_at_ms: sequence,
    }
}

/// Roots are trusted once each; a release's sequence is above every one's before it (the same
/// release again changes nothing), and the binaries of every release taken in are kept. A
/// release that names roots rotates them, and its revoked keys join those revoked by hand.
pub fn releases_only_go_up_and_their_binaries_are_kept(blank: Blank) {
    let store = open(blank, KEEP_FINAL_RUNS);
    let root =
        fleet_proto::pin::PinnedKey::parse(&format!("ed25519:{}", "A".repeat(43) + "=")).unwrap();
    assert!(store.release_roots().unwrap().is_empty());
    let once = std::slice::from_ref(&root);
    assert_eq!(store.trust_release_root(&root).unwrap(), once);
    assert_eq!(store.trust_release_root(&root).unwrap(), once);
    assert_eq!(store.release_roots().unwrap(), [root]);
    let (five, seven) = (release(5, b"agent 5"), release(7, b"agent 7"));
    assert_eq!(store.add_release(&five).unwrap(), super::ReleaseAdded::New);
    assert_eq!(store.add_release(&seven).unwrap(), super::ReleaseAdded::New);
    assert_eq!(
        store.add_release(&seven).unwrap(),
        super::ReleaseAdded::Already(Box::new(seven.clone()))
    );
    let refused = store.add_release(&release(6, b"agent 6")).unwrap_err();
    assert_eq!(
        refused.to_string(),
        "the coordinator store refused a change: the release's sequence 6 is not above 7, the sequence of release 0.7.0 taken in before: sign it with a higher --sequence"
    );
    assert_eq!(store.releases().unwrap(), [five, seven]);
    let kept = store.referenced_content().unwrap();
    assert!(kept.contains(&digest(b"agent 5")) && kept.contains(&digest(b"agent 7")));
    assert!(!kept.contains(&digest(b"agent 6")));
    let key = |c: &str| {
        fleet_proto::pin::PinnedKey::parse(&format!("ed25519:{}", c.repeat(42) + "A=")).unwrap()
    };
    let by_hand = store.revoke_release_key(&key("B")).unwrap();
    assert_eq!(by_hand.revoked, [key("B")]);
    let mut rotating = release(8, b"agent 8");
    rotating.manifest_read.roots = vec![key("C")];
    rotating.manifest_read.revoked_keys = vec![key("D"), key("B")];
    assert_eq!(
        store.add_release(&rotating).unwrap(),
        super::ReleaseAdded::New
    );
    let trust = store.release_trust().unwrap();
    assert_eq!(trust.roots, [key("C")]);
    assert_eq!(trust.revoked, [key("B"), key("D")]);
}

/// The first coordinator's key becomes the fleet's; a later one learns it and changes nothing.
pub fn the_first_key_is_the_fleets(blank: Blank) {
    let store = Store::open(blank(), KEEP_FINAL_RUNS).unwrap();
    assert_eq!(
        store.claim_fleet_key("ed25519:first").unwrap(),
        "ed25519:first"
    );
    assert_eq!(
        store.claim_fleet_key("ed25519:other").unwrap(),
        "ed25519:first"
    );
    assert_eq!(
        store.claim_fleet_key("ed25519:first").unwrap(),
        "ed25519:first"
    );
}

/// A store of another schema version is refused at open, with one line naming the store and
/// both versions.
pub fn schema_version_mismatch_refused(blank: Blank) {
    let backend = blank();
    let location = backend.location();
    backend.create(SCHEMA_VERSION + 1).unwrap();
    let err = Store::open(backend, KEEP_FINAL_RUNS)
        .err()
        .expect("another version is refused");
    match &err {
        StoreError::Schema {
            store,
            found,
            expected,
        } => {
            assert_eq!(store, &location);
            assert_eq!(
                (*found, *expected),
                (Some(SCHEMA_VERSION + 1), SCHEMA_VERSION)
            );
        }
        other => panic!("not a schema error: {other}"),
    }
    assert_newer_schema_refused(&err.to_string(), &location);

    let store = open(blank, KEEP_FINAL_RUNS);
    assert!(
        store.nodes().unwrap().is_empty(),
        "a blank backend opens empty"
    );
}

/// The one line a store of the next schema version is refused with.
pub fn assert_newer_schema_refused(message: &str, location: &str) {
    assert_eq!(
        message,
        format!(
            "the coordinator store {location} has schema version {}, but this coordinator reads version {SCHEMA_VERSION}: run the coordinator that wrote it, or move the store aside",
            SCHEMA_VERSION + 1
        )
    );
}

/// Retention counts each node's final runs apart: one node's many runs never push out another
/// node's rows (a set spread over a fleet keeps every row while it is read).
pub fn retention_is_per_node(blank: Blank) {
    let store = open(blank, 2);
    join(&store, NODE_A, KEY_A);
    join(&store, NODE_B, KEY_B);
    let mut runs = vec![run("b1", "s1", NODE_B, b"p", 1)];
    runs.extend((1..=4).map(|n| run(&format!("a{n}"), "s1", NODE_A, b"p", n)));
    create(&store, "s1", &runs);
    store
        .apply_events(&nid(NODE_B), &[event(1, "b1", RunState::Finished)])
        .unwrap();
    for n in 1..=4 {
        store
            .apply_events(
                &nid(NODE_A),
                &[event(n, &format!("a{n}"), RunState::Finished)],
            )
            .unwrap();
    }
    assert!(
        store.run(&rid("b1")).unwrap().is_some(),
        "B's only run is kept"
    );
    assert!(store.run(&rid("a1")).unwrap().is_none() && store.run(&rid("a2")).unwrap().is_none());
    assert!(store.run(&rid("a3")).unwrap().is_some() && store.run(&rid("a4")).unwrap().is_some());
    assert_eq!(final_count(&store), 2);
    assert_eq!(store.read(|tx| tx.final_count(&nid(NODE_B))).unwrap(), 1);
    let mut kept: Vec<RunId> = (store
        .set_runs(&"s1".into())
        .unwrap()
        .expect("the set stays"))
    .into_iter()
    .map(|r| r.id)
    .collect();
    kept.sort();
    assert_eq!(kept, ["a3", "a4", "b1"]);
}

/// The waiting index holds exactly the runs not taken yet, under their node: a start answered,
/// an event about the run (the answer may have been lost), or a final state takes it out.
pub fn waiting_index_follows_the_runs(blank: Blank) {
    let store = open(blank, KEEP_FINAL_RUNS);
    join(&store, NODE_A, KEY_A);
    join(&store, NODE_B, KEY_B);
    create(
        &store,
        "s1",
        &[
            run("r1", "s1", NODE_A, b"p", 1),
            run("r2", "s1", NODE_A, b"p", 2),
            run("r3", "s1", NODE_A, b"p", 3),
            run("r4", "s1", NODE_B, b"p", 4),
        ],
    );
    let nodes = |store: &Store| {
        let mut nodes = store.waiting_nodes().unwrap();
        nodes.sort();
        nodes
    };
    let indexed = |node: &str| {
        let mut ids = store.read(|tx| tx.waiting(&nid(node))).unwrap();
        ids.sort();
        ids
    };
    assert_eq!(nodes(&store), [NODE_A, NODE_B]);
    assert_eq!(indexed(NODE_A), ["r1", "r2", "r3"]);
    store.accept_runs(&[(rid("r1"), None)]).unwrap();
    store
        .apply_events(&nid(NODE_A), &[event(1, "r2", RunState::Running)])
        .unwrap();
    assert!(
        store.run(&rid("r2")).unwrap().unwrap().accepted,
        "an event takes the run"
    );
    store
        .fail_run(&rid("r3"), RunState::Failed, "swept")
        .unwrap();
    assert!(indexed(NODE_A).is_empty());
    assert_eq!(nodes(&store), [NODE_B], "only B still has runs waiting");
    assert_eq!(indexed(NODE_B), ["r4"]);
    store.accept_runs(&[(rid("r4"), None)]).unwrap();
    assert!(nodes(&store).is_empty());
    assert_eq!(
        active_ids(&store),
        ["r1", "r2", "r4"],
        "taken runs stay active"
    );
}

/// Many sessions' changes in one transaction: each is applied and answered as if alone, and a
/// change that cannot be applied (a node that never joined) fails alone.
pub fn changes_applied_together_each_answered(blank: Blank) {
    let store = open(blank, KEEP_FINAL_RUNS);
    join(&store, NODE_A, KEY_A);
    join(&store, NODE_B, KEY_B);
    create(
        &store,
        "s1",
        &[
            run("r1", "s1", NODE_A, b"p", 1),
            run("r2", "s1", NODE_B, b"p", 2),
        ],
    );
    let beat = |node: &str, at_ms| Beat {
        node_id: node.into(),
        at_ms: Some(at_ms),
        lease_until_ms: at_ms + 1_000,
    };
    let changes = [
        Change::OpenSession {
            node_id: NODE_A.into(),
            lease_until_ms: 5_000,
            at: Some("coordinator-2:18426".into()),
            protocol: fleet_proto::version::ProtocolVersion(1),
        },
        Change::Accept(vec![(rid("r1"), None), (rid("r2"), None)]),
        Change::Events {
            node_id: NODE_A.into(),
            events: vec![event(1, "r1", RunState::Finished)],
        },
        Change::Events {
            node_id: "n-never-joined".into(),
            events: vec![event(1, "r2", RunState::Finished)],
        },
        Change::Beats(vec![beat(NODE_B, 7_000), beat("n-never-joined", 7_000)]),
        Change::Events {
            node_id: NODE_B.into(),
            events: vec![event(4, "r2", RunState::Running)],
        },
    ];
    let answers = store.apply(&changes);
    assert_eq!(answers.len(), changes.len(), "one answer per change");
    assert_eq!(answers[0].as_ref().ok(), Some(&Applied::Generation(1)));
    assert_eq!(answers[1].as_ref().ok(), Some(&Applied::Done));
    assert_eq!(events_up_to(&answers[2]), Some(1));
    let moved = moved_states(&answers[2]);
    assert_eq!(moved, [RunState::Finished], "the event moved r1 once");
    assert!(
        matches!(&answers[3], Err(StoreError::Corrupt(what)) if what.contains("n-never-joined")),
        "{:?}",
        answers[3]
    );
    assert_eq!(answers[4].as_ref().ok(), Some(&Applied::Done));
    assert_eq!(events_up_to(&answers[5]), Some(4));
    assert_eq!(moved_states(&answers[5]), [RunState::Running]);
    assert_eq!(state_of(&store, "r1"), RunState::Finished);
    assert_eq!(state_of(&store, "r2"), RunState::Running);
    let a = store.node(&nid(NODE_A)).unwrap().unwrap();
    assert_eq!(
        a.session_at.as_deref(),
        Some("coordinator-2:18426"),
        "the coordinator holding the session"
    );
    assert_eq!(
        a.protocol,
        Some(super::NodeProtocol::Speaks {
            version: fleet_proto::version::ProtocolVersion(1)
        }),
        "the version its session speaks"
    );
    let b = store.node(&nid(NODE_B)).unwrap().unwrap();
    assert_eq!(
        (b.last_heartbeat_ms, b.lease_until_ms),
        (Some(7_000), 8_000)
    );
    assert!(store.node(&nid("n-never-joined")).unwrap().is_none());
    let again = store.apply(&changes[..3]);
    assert_eq!(again[0].as_ref().ok(), Some(&Applied::Generation(2)));
    assert_eq!(
        events_up_to(&again[2]),
        Some(1),
        "a change applied twice is deduped as a node's resent event is"
    );
    assert!(
        moved_states(&again[2]).is_empty(),
        "a deduped event moves no run"
    );
}

/// Several changes of one node in one transaction (a backend may hold their writes until
/// commit): each reads what the ones before it wrote, and the record stored is the sum.
pub fn one_nodes_changes_in_one_batch_read_each_others_writes(blank: Blank) {
    let store = open(blank, KEEP_FINAL_RUNS);
    join(&store, NODE_A, KEY_A);
    create(
        &store,
        "s1",
        &[
            run("r1", "s1", NODE_A, b"p", 1),
            run("r2", "s1", NODE_A, b"p", 2),
        ],
    );
    let open_session = |lease_until_ms| Change::OpenSession {
        node_id: NODE_A.into(),
        lease_until_ms,
        at: Some("coordinator-1:18426".into()),
        protocol: fleet_proto::version::ProtocolVersion(2),
    };
    let facts = facts("aarch64", 4);
    let changes = [
        open_session(5_000),
        Change::Events {
            node_id: NODE_A.into(),
            events: vec![event(1, "r1", RunState::Running)],
        },
        Change::Events {
            node_id: NODE_A.into(),
            events: vec![
                event(1, "r1", RunState::Running),
                event(2, "r2", RunState::Running),
            ],
        },
        open_session(4_000),
        Change::Facts {
            beat: Beat {
                node_id: NODE_A.into(),
                at_ms: Some(6_000),
                lease_until_ms: 9_000,
            },
            facts: Box::new(facts),
        },
        open_session(3_000),
    ];
    let answers = store.apply(&changes);
    assert_eq!(answers[0].as_ref().ok(), Some(&Applied::Generation(1)));
    assert_eq!(events_up_to(&answers[1]), Some(1));
    assert_eq!(events_up_to(&answers[2]), Some(2));
    assert_eq!(
        moved_states(&answers[2]),
        [RunState::Running],
        "the event the change before stored is not stored again"
    );
    assert_eq!(answers[3].as_ref().ok(), Some(&Applied::Generation(2)));
    assert_eq!(answers[4].as_ref().ok(), Some(&Applied::Done));
    assert_eq!(answers[5].as_ref().ok(), Some(&Applied::Generation(3)));
    let a = store.node(&nid(NODE_A)).unwrap().unwrap();
    assert_eq!(a.generation, 3);
    assert_eq!(
        (a.last_heartbeat_ms, a.lease_until_ms, a.last_event_id),
        (Some(6_000), 9_000, 2),
        "the greatest lease, the time heard and the last event stored"
    );
    assert_eq!(a.facts.as_ref().map(|f| f.cpus), Some(4), "{a:?}");
    assert_eq!(store.lease_ends().unwrap(), [(nid(NODE_A), 9_000)]);
    assert_eq!(a.session_at.as_deref(), Some("coordinator-1:18426"));
    assert_eq!(state_of(&store, "r2"), RunState::Running);
}

fn events_up_to(answer: &StoreResult<Applied>) -> Option<u64> {
    match answer {
        Ok(Applied::Events { up_to, .. }) => Some(*up_to),
        _ => None,
    }
}

fn moved_states(answer: &StoreResult<Applied>) -> Vec<RunState> {
    match answer {
        Ok(Applied::Events { moved, .. }) => moved.iter().map(|m| m.state).collect(),
        other => panic!("events were answered with {other:?}"),
    }
}

/// A drain keeps its first time, survives a session and a heartbeat, refuses a set with a run
/// for the node (nothing recorded), and goes with an undrain; runs out are counted per node.
pub fn a_drain_is_kept_and_refuses_new_runs(blank: Blank) {
    let store = open(blank, KEEP_FINAL_RUNS);
    join(&store, NODE_A, KEY_A);
    join(&store, NODE_B, KEY_B);
    create(
        &store,
        "s1",
        &[
            run("r1", "s1", NODE_A, b"p", 1),
            run("r2", "s1", NODE_A, b"p", 2),
            run("r3", "s1", NODE_B, b"p", 3),
        ],
    );
    let counts = store.runs_out().unwrap();
    assert_eq!(counts.get(&nid(NODE_A)), Some(&2));
    assert_eq!(counts.get(&nid(NODE_B)), Some(&1));
    assert!(
        store
            .set_drain(&nid("n-unknown"), Some(5))
            .unwrap()
            .is_none()
    );
    let drained = store.set_drain(&nid(NODE_A), Some(5)).unwrap().unwrap();
    assert_eq!(drained.drained_since_ms, Some(5));
    let again = store.set_drain(&nid(NODE_A), Some(9)).unwrap().unwrap();
    assert_eq!(
        again.drained_since_ms,
        Some(5),
        "a drain keeps its first time"
    );
    store.open_session(&nid(NODE_A), 10_000).unwrap();
    let left = store
        .write_leases(&[Beat {
            node_id: nid(NODE_A),
            at_ms: Some(20),
            lease_until_ms: 20_000,
        }])
        .unwrap();
    assert!(left.is_empty(), "no record was held: {left:?}");
    let node = store.node(&nid(NODE_A)).unwrap().unwrap();
    assert_eq!(
        node.drained_since_ms,
        Some(5),
        "kept across a session and a beat"
    );
    let closed = store.read(|tx| tx.closed_nodes()).unwrap();
    assert_eq!(closed.len(), 1, "only the drained node: {closed:?}");
    assert_eq!(
        (closed[0].id.as_str(), closed[0].drained_since_ms),
        (NODE_A, Some(5))
    );
    assert_eq!(closed[0].lease_until_ms, 20_000, "with its lease");
    let refused = store.create_set(
        &"s2".into(),
        &[
            run("r4", "s2", NODE_B, b"p", 4),
            run("r5", "s2", NODE_A, b"p", 5),
        ],
    );
    assert!(
        matches!(&refused, Err(StoreError::Refused(why)) if why.contains("n-a is draining")),
        "{refused:?}"
    );
    assert!(
        store.set_runs(&"s2".into()).unwrap().is_none(),
        "nothing recorded"
    );
    assert_eq!(store.runs_out().unwrap().get(&nid(NODE_B)), Some(&1));
    store
        .apply_events(&nid(NODE_A), &[event(1, "r1", RunState::Finished)])
        .unwrap();
    assert_eq!(store.runs_out().unwrap().get(&nid(NODE_A)), Some(&1));
    let back = store.set_drain(&nid(NODE_A), None).unwrap().unwrap();
    assert_eq!(back.drained_since_ms, None);
    assert!(store.read(|tx| tx.closed_nodes()).unwrap().is_empty());
    create(&store, "s3", &[run("r6", "s3", NODE_A, b"p", 6)]);
    assert_eq!(store.runs_out().unwrap().get(&nid(NODE_A)), Some(&2));
}

/// The operator's capacity is kept, read back and counted as a node change; the dispatch view lists a node's waiting runs
/// as created (a set's in its own order, whatever their ids) and counts the runs it holds.
pub fn a_capacity_is_kept_and_runs_go_out_in_order(blank: Blank) {
    let store = open(blank, KEEP_FINAL_RUNS);
    join(&store, NODE_A, KEY_A);
    assert!(
        store
            .set_capacity(&nid("n-unknown"), Some(2))
            .unwrap()
            .is_none()
    );
    assert_eq!(
        store.node_changes().unwrap(),
        0,
        "an unknown node counts nothing"
    );
    let set = store.set_capacity(&nid(NODE_A), Some(2)).unwrap().unwrap();
    assert_eq!((set.capacity, set.capacity()), (Some(2), Some(2)));
    assert_eq!(
        store.node_changes().unwrap(),
        1,
        "the other coordinators see the capacity change"
    );
    let mut runs = Vec::new();
    for (i, id) in ["r-z", "r-a", "r-m"].into_iter().enumerate() {
        let mut r = run(id, "s1", NODE_A, b"p", 7);
        r.position = i as u32;
        runs.push(r);
    }
    create(&store, "s1", &runs);
    create(&store, "s0", &[run("r-b", "s0", NODE_A, b"p", 8)]);
    let (waiting, out, node) = store.dispatch_view(&nid(NODE_A)).unwrap();
    let order: Vec<&str> = waiting.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(
        order,
        ["r-z", "r-a", "r-m", "r-b"],
        "created order, then set order"
    );
    assert_eq!(out, 4);
    assert_eq!(node.and_then(|n| n.capacity), Some(2), "kept");
    store
        .apply_events(&nid(NODE_A), &[event(1, "r-z", RunState::Running)])
        .unwrap();
    let (waiting, out, _) = store.dispatch_view(&nid(NODE_A)).unwrap();
    assert_eq!(
        (waiting.len(), out),
        (3, 4),
        "a taken run is out, not waiting"
    );
    store
        .apply_events(&nid(NODE_A), &[event(2, "r-z", RunState::Finished)])
        .unwrap();
    let (_, out, _) = store.dispatch_view(&nid(NODE_A)).unwrap();
    assert_eq!(out, 3, "a final run holds no slot");
    // The briefs `status` reads agree with the records: the agent's own limit, the operator's,
    // the lower of both, and the lease.
    store
        .heartbeat(&nid(NODE_A), 2_600, 4_100, Some(facts("x86_64", 3)))
        .unwrap();
    let brief = |capacity| NodeBrief {
        id: nid(NODE_A),
        lease_until_ms: 4_100,
        capacity,
    };
    assert_eq!(
        store.node_briefs().unwrap(),
        [brief(Some(2))],
        "the operator's, lower"
    );
    store.set_capacity(&nid(NODE_A), Some(5)).unwrap();
    assert_eq!(
        store.node_briefs().unwrap(),
        [brief(Some(3))],
        "the agent's, lower"
    );
    let lifted = store.set_capacity(&nid(NODE_A), None).unwrap().unwrap();
    assert_eq!(lifted.capacity(), Some(3), "the agent's own limit stays");
    assert_eq!(store.node_briefs().unwrap(), [brief(Some(3))]);
}

/// Retiring a node that holds runs is refused (nothing changes) unless discarded; an ended node
/// loses its runs with the end as their reason, is counted once, refuses new runs and is not
/// ended the other way; forget refuses a live node and removes an ended one, whose runs stay.
pub fn ending_a_node_loses_its_runs_and_forget_removes_it(blank: Blank) {
    let store = open(blank, KEEP_FINAL_RUNS);
    join_live(&store, NODE_A, KEY_A);
    join_live(&store, NODE_B, KEY_B);
    create(
        &store,
        "s1",
        &[
            run("r1", "s1", NODE_A, b"p", 1),
            run("r2", "s1", NODE_A, b"p", 2),
            run("r3", "s1", NODE_B, b"p", 3),
        ],
    );
    store
        .apply_events(&nid(NODE_A), &[event(1, "r1", RunState::Finished)])
        .unwrap();
    assert_eq!(store.node_changes().unwrap(), 0);
    assert!(matches!(
        store.end_node(&nid("n-unknown"), NodeEnd::Revoked, false, 5),
        Ok(EndOutcome::Unknown)
    ));
    let held = store.end_node(&nid(NODE_A), NodeEnd::Retired, false, 5);
    assert!(matches!(held, Ok(EndOutcome::HoldsRuns(1))), "{held:?}");
    assert!(store.node(&nid(NODE_A)).unwrap().unwrap().ended.is_none());
    assert_eq!(store.node_changes().unwrap(), 0, "a refusal counts nothing");
    let Ok(EndOutcome::Ended { node, lost }) =
        store.end_node(&nid(NODE_A), NodeEnd::Retired, true, 6)
    else {
        panic!("a discarding retire ends the node");
    };
    assert_eq!(lost, 1);
    assert_eq!(
        node.ended,
        Some(Ending {
            end: NodeEnd::Retired,
            at_ms: 6
        })
    );
    let row = store.run(&rid("r2")).unwrap().unwrap();
    assert_eq!(row.state, RunState::Lost);
    assert_eq!(row.error.as_deref(), Some("retired"));
    let done = store.run(&rid("r1")).unwrap().unwrap();
    assert_eq!(
        done.state,
        RunState::Finished,
        "a final run stays as it was"
    );
    assert_eq!(store.node_changes().unwrap(), 1);
    assert!(
        matches!(
            store.end_node(&nid(NODE_A), NodeEnd::Retired, false, 7),
            Ok(EndOutcome::Ended { lost: 0, .. })
        ),
        "retiring again changes nothing"
    );
    assert!(matches!(
        store.end_node(&nid(NODE_A), NodeEnd::Revoked, false, 7),
        Ok(EndOutcome::AlreadyEnded(NodeEnd::Retired))
    ));
    assert_eq!(store.node_changes().unwrap(), 1);
    let refused = store.create_set(&"s2".into(), &[run("r4", "s2", NODE_A, b"p", 4)]);
    assert!(
        matches!(&refused, Err(StoreError::Refused(why)) if why.contains("n-a is retired")),
        "{refused:?}"
    );
    let Ok(EndOutcome::Ended { lost, .. }) =
        store.end_node(&nid(NODE_B), NodeEnd::Revoked, false, 8)
    else {
        panic!("a revoke ends a node that holds runs");
    };
    assert_eq!(lost, 1);
    assert_eq!(
        store.run(&rid("r3")).unwrap().unwrap().error.as_deref(),
        Some("revoked")
    );
    assert_eq!(store.node_changes().unwrap(), 2);
    join_live(&store, NODE_C, KEY_C);
    assert!(matches!(
        store.forget_node(&nid(NODE_C), 9),
        Ok(ForgetOutcome::Live)
    ));
    assert!(matches!(
        store.forget_node(&nid(NODE_A), 9),
        Ok(ForgetOutcome::Forgotten(_))
    ));
    assert!(store.node(&nid(NODE_A)).unwrap().is_none());
    assert!(matches!(
        store.forget_node(&nid(NODE_A), 9),
        Ok(ForgetOutcome::Unknown)
    ));
    assert_eq!(store.nodes().unwrap().len(), 2);
    assert!(
        store.run(&rid("r2")).unwrap().is_some(),
        "its runs stay as history"
    );
    assert!(
        matches!(
            store.forget_node(&nid(NODE_C), u64::MAX),
            Ok(ForgetOutcome::Forgotten(_))
        ),
        "a node past its lease may be forgotten"
    );
}

/// A run lost with retries left is placed again in the same transaction: a new waiting row of
/// its set on another matching node (attempt 2, naming the lost one, which names it, one retry
/// fewer, one more reference on its program); lost again with none left, it stays lost. A run
/// that fails (not lost) is never placed again.
pub fn a_lost_run_with_retries_is_placed_again_once(blank: Blank) {
    let store = open(blank, KEEP_FINAL_RUNS);
    join_live(&store, NODE_A, KEY_A);
    join_live(&store, NODE_B, KEY_B);
    let retry = Some(super::Retry {
        left: 1,
        place: crate::placement::Selector::parse("name!=nobody").unwrap(),
    });
    let first = RunRow {
        retry: retry.clone(),
        ..run("r1", "s1", NODE_A, b"p", 1)
    };
    let failing = RunRow {
        retry,
        ..run("r2", "s1", NODE_A, b"p", 2)
    };
    create(&store, "s1", &[first, failing]);
    let failed = store
        .fail_run(&rid("r2"), RunState::Failed, "nobody took it")
        .unwrap();
    assert!(
        failed.unwrap().retried_as.is_none(),
        "a failed run is not placed again"
    );
    let lost = store
        .fail_run(&rid("r1"), RunState::Lost, "node n-a stopped answering")
        .unwrap()
        .unwrap();
    let next_id = lost.retried_as.clone().expect("placed again");
    assert_eq!(
        store.run(&rid("r1")).unwrap().unwrap().retried_as.as_ref(),
        Some(&next_id)
    );
    let next = store.run(&next_id).unwrap().unwrap();
    assert_eq!(next.node_id, nid(NODE_B), "on another node");
    assert_eq!((next.state, next.attempt), (RunState::Waiting, 2));
    assert_eq!(next.previous, Some(rid("r1")));
    assert_eq!(next.retry.as_ref().map(|r| r.left), Some(0));
    let ids: Vec<RunId> = store
        .set_runs(&"s1".into())
        .unwrap()
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(ids, vec![rid("r1"), rid("r2"), next_id.clone()]);
    assert_eq!(store.waiting_runs(&nid(NODE_B)).unwrap().len(), 1);
    let digest = next.content()[0];
    assert_eq!(store.unreferenced(&[digest]).unwrap().len(), 0);
    let again = store
        .fail_run(&next_id, RunState::Lost, "node n-b stopped answering")
        .unwrap()
        .unwrap();
    assert!(again.retried_as.is_none(), "no retry left");
    assert_eq!(store.set_runs(&"s1".into()).unwrap().unwrap().len(), 3);
}

/// Runs queued for a match (under `unplaced`) stay there while no node matches; once one does,
/// each goes, oldest first, to a matching node that holds no row of its set, out of the queue's
/// indexes into the node's; what finds no such node stays queued.
pub fn runs_queued_for_a_match_go_to_distinct_matching_nodes(blank: Blank) {
    let store = open(blank, KEEP_FINAL_RUNS);
    join_live(&store, NODE_A, KEY_A);
    let queue = super::unplaced();
    let queued = |id: &str, created: u64| RunRow {
        node_id: queue.clone(),
        queued_for: Some(crate::placement::Selector::parse("name!=nobody").unwrap()),
        ..run(id, "s1", NODE_A, b"p", created)
    };
    create(
        &store,
        "s1",
        &[
            run("r1", "s1", NODE_A, b"p", 1),
            queued("r2", 2),
            queued("r3", 3),
        ],
    );
    assert!(
        store.place_queued(10).unwrap().is_empty(),
        "n-a holds a row of the set"
    );
    assert_eq!(store.waiting_runs(&queue).unwrap().len(), 2);
    join_live(&store, NODE_B, KEY_B);
    assert_eq!(store.place_queued(11).unwrap(), vec![nid(NODE_B)]);
    let r2 = store.run(&rid("r2")).unwrap().unwrap();
    assert_eq!((r2.node_id, r2.state), (nid(NODE_B), RunState::Waiting));
    assert_eq!(
        store.run(&rid("r3")).unwrap().unwrap().node_id,
        queue,
        "the newer one still waits"
    );
    assert_eq!(store.waiting_runs(&queue).unwrap().len(), 1);
    assert_eq!(store.waiting_runs(&nid(NODE_B)).unwrap().len(), 1);
    assert_eq!(store.runs_out().unwrap().get(&nid(NODE_B)), Some(&1));
    assert_eq!(store.runs_out().unwrap().get(&queue), Some(&1));
}
