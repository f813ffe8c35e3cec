//! Unit tests of the store: records survive reopening, ids are never reused, bad files fail closed.
use super::*;
use fleet_proto::run::{RunReport, RunState, Workload};
use serde_json::json;

fn program() -> Workload {
    Workload::Program(fleet_proto::Digest::parse(&format!("sha256:{}", "ab".repeat(32))).unwrap())
}

fn dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("agent-state-")
        .tempdir()
        .unwrap()
}

#[test]
fn an_applied_operation_is_answered_from_its_first_record_after_reopening() {
    let d = dir();
    let store = Store::open(d.path()).unwrap();
    assert_eq!(store.applied::<serde_json::Value>("op-1").unwrap(), None);
    store.record_applied("op-1", &json!({"ok": true})).unwrap();
    store.record_applied("op-1", &json!({"ok": false})).unwrap();
    drop(store);
    let store = Store::open(d.path()).unwrap();
    assert_eq!(store.applied("op-1").unwrap(), Some(json!({"ok": true})));
    assert_eq!(store.applied::<serde_json::Value>("op-2").unwrap(), None);
}

#[test]
fn answers_and_run_claims_are_kept_typed_and_the_first_of_each_stays() {
    use fleet_proto::protocol::{Answer, Refusal, RefusalClass, Reply};
    let d = dir();
    let store = Store::open(d.path()).unwrap();
    let stopped: Answer = Ok(Reply::Stopped {
        run_id: fleet_proto::RunId::parse("r-1").unwrap(),
    });
    store.record_answer("stop-1", &stopped).unwrap();
    let refused: Answer = Err(Refusal::new(RefusalClass::Other, "no"));
    store.record_answer("stop-1", &refused).unwrap();
    assert_eq!(store.run_claim(&as_run_id("r-1")).unwrap(), None);
    store.claim_run(&as_run_id("r-1"), "start-1").unwrap();
    store.claim_run(&as_run_id("r-1"), "start-2").unwrap();
    drop(store);
    let store = Store::open(d.path()).unwrap();
    assert_eq!(store.answer_of("stop-1").unwrap(), Some(stopped));
    assert_eq!(store.answer_of("stop-2").unwrap(), None);
    assert_eq!(
        store.run_claim(&as_run_id("r-1")).unwrap().as_deref(),
        Some("start-1")
    );
    // A record that is not an answer is refused naming it, never taken for one.
    store.record_applied("odd", &json!({"n": 1})).unwrap();
    let err = store.answer_of("odd").unwrap_err().to_string();
    assert!(
        err.contains("its operation record odd does not decode"),
        "{err}"
    );
}

#[test]
fn event_ids_are_monotonic_and_never_reused_after_acks_and_reopening() {
    let d = dir();
    let store = Store::open(d.path()).unwrap();
    let ids: Vec<u64> = (0..3)
        .map(|i| {
            store
                .append_event(
                    &as_run_id("r1"),
                    RunState::Running,
                    RunReport::error(i.to_string()),
                )
                .unwrap()
                .id
        })
        .collect();
    assert_eq!(ids, [1, 2, 3]);
    assert_eq!(store.ack_events(2).unwrap(), 2);
    let pending = store.pending_events(0, 10).unwrap();
    assert_eq!(pending.len(), 1);
    assert_eq!(
        (pending[0].id, &pending[0].report),
        (3, &RunReport::error("2"))
    );
    assert_eq!(store.ack_events(3).unwrap(), 1);
    drop(store);
    let store = Store::open(d.path()).unwrap();
    assert_eq!(store.last_event_id().unwrap(), 3);
    let next = store
        .append_event(&as_run_id("r1"), RunState::Finished, RunReport::default())
        .unwrap();
    assert_eq!(next.id, 4);
    assert_eq!(store.pending_events(3, 10).unwrap(), vec![next]);
    assert_eq!(store.pending_events(4, 10).unwrap(), vec![]);
}

#[test]
fn a_recorded_start_is_kept_without_its_credential_until_the_run_moves_on() {
    use fleet_proto::protocol::StartRun;
    use fleet_proto::run::RegistryAuth;
    let d = dir();
    let store = Store::open(d.path()).unwrap();
    let start = StartRun {
        run_id: fleet_proto::RunId::parse("r1").unwrap(),
        workload: program(),
        registry_auth: Some(RegistryAuth {
            username: "ci".into(),
            password: "secret-password".into(),
        }),
        options: Default::default(),
    };
    let launch = Launch::of("start-r1", &start);
    assert!(launch.had_registry_auth && launch.start.registry_auth.is_none());
    store.track_launch(&launch, &[]).unwrap().unwrap();
    drop(store);
    let bytes = std::fs::read(d.path().join(FILE_NAME)).unwrap();
    assert!(
        !bytes.windows(15).any(|w| w == b"secret-password"),
        "the credential reached the disk"
    );
    let store = Store::open(d.path()).unwrap();
    assert_eq!(
        store.run(&as_run_id("r1")).unwrap().unwrap().launch,
        Some(launch)
    );
    store
        .transition(&as_run_id("r1"), RunState::Running, RunReport::default())
        .unwrap();
    assert_eq!(store.run(&as_run_id("r1")).unwrap().unwrap().launch, None);
}

#[test]
fn each_run_transition_is_spooled_once_and_final_states_stay_final() {
    let d = dir();
    let store = Store::open(d.path()).unwrap();
    let starting = store
        .track_run(&as_run_id("r1"), &program())
        .unwrap()
        .unwrap();
    assert_eq!((starting.state, starting.id), (RunState::Starting, 1));
    assert_eq!(store.track_run(&as_run_id("r1"), &program()).unwrap(), None);
    assert!(
        store
            .transition(&as_run_id("r1"), RunState::Running, RunReport::default())
            .unwrap()
            .is_some()
    );
    assert_eq!(
        store
            .transition(&as_run_id("r1"), RunState::Running, RunReport::default())
            .unwrap(),
        None
    );
    assert_eq!(
        store
            .transition(&as_run_id("r1"), RunState::Starting, RunReport::default())
            .unwrap(),
        None
    );
    assert_eq!(store.active_runs().unwrap().len(), 1);
    let done = store
        .transition(&as_run_id("r1"), RunState::Finished, RunReport::default())
        .unwrap();
    assert_eq!(done.unwrap().id, 3);
    assert_eq!(
        store
            .transition(&as_run_id("r1"), RunState::Lost, RunReport::default())
            .unwrap(),
        None
    );
    assert_eq!(store.active_runs().unwrap(), vec![]);
    let record = store.run(&as_run_id("r1")).unwrap().unwrap();
    assert_eq!(
        (record.state, record.workload),
        (RunState::Finished, program())
    );
    let states: Vec<RunState> = store
        .pending_events(0, 10)
        .unwrap()
        .iter()
        .map(|e| e.state)
        .collect();
    assert_eq!(
        states,
        [RunState::Starting, RunState::Running, RunState::Finished]
    );
    let err = store
        .transition(&as_run_id("nope"), RunState::Running, RunReport::default())
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "run nope is not known to this node; start it before reporting its state"
    );
}

#[test]
fn a_superseded_generation_is_refused_and_the_newest_survives_reopening() {
    let d = dir();
    let store = Store::open(d.path()).unwrap();
    assert_eq!(store.generation().unwrap(), 0);
    store.check_generation(3).unwrap();
    store.check_generation(3).unwrap();
    let err = store.check_generation(2).unwrap_err();
    assert_eq!(
        err.to_string(),
        "command from session generation 2 refused: generation 3 superseded it; reconnect to get a current session"
    );
    drop(store);
    let store = Store::open(d.path()).unwrap();
    assert_eq!(store.generation().unwrap(), 3);
    store.check_generation(4).unwrap();
    assert!(store.check_generation(3).is_err());
}

fn open_error(d: &tempfile::TempDir) -> String {
    Store::open(d.path()).unwrap_err().to_string()
}

#[test]
fn a_garbage_or_empty_file_fails_closed_naming_it() {
    let d = dir();
    let path = d.path().join(FILE_NAME);
    std::fs::write(&path, vec![0x5a; 8192]).unwrap();
    let expected = format!(
        "agent state {} cannot be read: it is not a redb database (empty, truncated or overwritten); restore it or move it aside deliberately, the agent never starts over on its own",
        path.display()
    );
    assert_eq!(open_error(&d), expected);
    // The file is left as it was: nothing was re-initialised.
    assert_eq!(std::fs::read(&path).unwrap(), vec![0x5a; 8192]);

    std::fs::write(&path, b"").unwrap();
    assert_eq!(open_error(&d), expected);
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 0);
}

#[test]
fn a_redb_file_without_the_schema_or_of_another_version_is_refused() {
    let d = dir();
    let path = d.path().join(FILE_NAME);
    drop(redb::Database::create(&path).unwrap());
    assert_eq!(
        open_error(&d),
        format!(
            "agent state {} cannot be read: it is a redb file without the agent's schema version; restore it or move it aside deliberately, the agent never starts over on its own",
            path.display()
        )
    );
    let db = redb::Database::open(&path).unwrap();
    let tx = db.begin_write().unwrap();
    tx.open_table(META).unwrap().insert(META_SCHEMA, 7).unwrap();
    tx.commit().unwrap();
    drop(db);
    assert_eq!(
        open_error(&d),
        format!(
            "agent state {} has schema version 7 but this agent reads version 2; run the agent version that wrote it",
            path.display()
        )
    );
}

#[test]
fn a_second_opener_is_told_the_store_is_in_use() {
    let d = dir();
    let _first = Store::open(d.path()).unwrap();
    assert_eq!(
        open_error(&d),
        format!(
            "agent state {} is in use by another process; stop the other fleet-agent using this state directory",
            d.path().join(FILE_NAME).display()
        )
    );
}

#[test]
fn a_state_directory_that_cannot_be_created_is_named() {
    let d = dir();
    let file = d.path().join("plain-file");
    std::fs::write(&file, b"x").unwrap();
    let err = Store::open(&file.join("state")).unwrap_err().to_string();
    assert!(
        err.starts_with(&format!(
            "cannot create agent state {}: ",
            file.join("state").join(FILE_NAME).display()
        )),
        "{err}"
    );
    assert!(
        err.ends_with("; make the state directory writable"),
        "{err}"
    );
}

#[test]
fn a_leftover_temporary_file_from_a_crash_during_creation_is_replaced_by_a_fresh_store() {
    let d = dir();
    std::fs::write(d.path().join("agent.redb.tmp"), b"half written").unwrap();
    let store = Store::open(d.path()).unwrap();
    assert_eq!(store.last_event_id().unwrap(), 0);
    assert!(!d.path().join("agent.redb.tmp").exists());
}

#[test]
fn insertion_order_pruning_forgets_only_the_oldest_beyond_the_window() {
    const ORDER: TableDefinition<u64, &str> = TableDefinition::new("test_order");
    const DATA: TableDefinition<&str, &[u8]> = TableDefinition::new("test_data");
    let d = dir();
    let store = Store::open(d.path()).unwrap();
    store
        .write(|tx| {
            for n in 0..5 {
                let key = format!("k{n}");
                tx.open_table(DATA)
                    .unwrap()
                    .insert(key.as_str(), b"v".as_slice())
                    .unwrap();
                store.remember_in_order(tx, ORDER, DATA, "test_seq", &key, 3)?;
            }
            Ok(())
        })
        .unwrap();
    let kept: Vec<String> = store
        .read(|tx| {
            let data = tx.open_table(DATA).unwrap();
            Ok(data
                .iter()
                .unwrap()
                .map(|e| e.unwrap().0.value().to_string())
                .collect())
        })
        .unwrap();
    assert_eq!(kept, ["k2", "k3", "k4"]);
}

#[test]
fn a_truncated_store_fails_closed_and_never_opens_empty() {
    let d = dir();
    let store = Store::open(d.path()).unwrap();
    for n in 0..50 {
        store
            .record_applied(&format!("op-{n}"), &json!({ "n": n }))
            .unwrap();
    }
    drop(store);
    let path = d.path().join(FILE_NAME);
    let len = std::fs::metadata(&path).unwrap().len();
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    file.set_len(len / 2).unwrap();
    drop(file);
    let err = Store::open(d.path()).unwrap_err().to_string();
    assert!(
        err.starts_with(&format!(
            "agent state {} cannot be read: it is truncated or damaged (redb: ",
            path.display()
        )),
        "{err}"
    );
    assert!(err.ends_with(
        "; restore it or move it aside deliberately, the agent never starts over on its own"
    ));
    assert_eq!(
        std::fs::metadata(&path).unwrap().len(),
        len / 2,
        "the file is left as it was"
    );
}

/// A run id the test names.
fn as_run_id(s: &str) -> fleet_proto::RunId {
    fleet_proto::RunId::parse(s).unwrap()
}
