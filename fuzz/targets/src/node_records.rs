//! `node_records`: what a machine reads back from its own disk after a crash, where a torn
//! write or a damaged disk can leave anything. The first byte picks the record:
//!
//! - `a`, `b`, `c`: a run record, a spooled event, an applied operation (and a run's claim) as
//!   the bytes of a value in the agent's store (`agent.redb`), read through [`Store`]: the record
//!   reads back as exactly the value its JSON holds, or the read fails naming the record's key and
//!   the store's path; never a panic. A run record read is carried on by a transition, an event is
//!   acked, as the agent does after a restart.
//! - `d`: the membership record (`membership.json`): a record read is written back and read to
//!   the same value; a corrupt one names its file.
//! - `e`: the node key (`node.key`, PEM): an Ed25519 key or an error naming the file.
//! - `f`: a run's `result.json` and `supervisor.json` (NUL-separated) in a run store, through
//!   [`run_store::state::read_result`] and [`run_store::Store::status`]: a result read is the
//!   run's own, of schema 1, and reads back as written; a torn one names its file.
//! - `g`: a whole `agent.redb` (a torn or damaged file): opening and reading it fails with an
//!   error naming the file, never a panic that escapes the store (a panic redb raises while
//!   opening is caught there, as in the agent's unwinding builds).
use crate::support::{fresh_dir, sections, select, value};
use fleet_agent::identity;
use fleet_agent::state::{FILE_NAME, SCHEMA_VERSION, StateError, Store};
use fleet_proto::protocol::Answer;
use fleet_proto::run::{Event, RunReport, RunState};
use redb::{Database, TableDefinition};
use std::path::Path;

const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const RUNS: TableDefinition<&str, &[u8]> = TableDefinition::new("runs");
const EVENTS: TableDefinition<u64, &[u8]> = TableDefinition::new("events");
const OPS: TableDefinition<&str, &[u8]> = TableDefinition::new("ops");

const RUN: &str = "fuzz";

/// [`RUN`] as the store takes it.
fn run_id() -> fleet_proto::RunId {
    fleet_proto::RunId::parse(RUN).expect("a run id")
}
const OP: &str = "op-fuzz";

pub fn node_records(data: &[u8]) {
    let Some((which, rest)) = select(data, 7) else {
        return;
    };
    match which {
        0 => run_record(rest),
        1 => event_record(rest),
        2 => op_record(rest),
        3 => membership(rest),
        4 => node_key(rest),
        5 => run_result(rest),
        _ => store_file(rest),
    }
}

/// A store whose one table `table` holds `bytes` under `key`, as a crash may have left it.
fn store_with<K: redb::Key + 'static>(
    table: TableDefinition<K, &[u8]>,
    key: K::SelfType<'_>,
    bytes: &[u8],
) -> (Store, std::path::PathBuf) {
    let dir = fresh_dir("node_records-state");
    let path = dir.join(FILE_NAME);
    {
        let builder = Database::builder();
        // Under cargo-fuzz (`--cfg fuzzing`) redb lets a file have small regions: a store file
        // a third of the size, made and closed in less time.
        #[cfg(fuzzing)]
        let builder = {
            let mut builder = builder;
            builder.set_region_size(1 << 14);
            builder
        };
        let db = builder.create(&path).expect("a store file");
        let mut tx = db.begin_write().expect("a write");
        tx.set_durability(redb::Durability::None);
        tx.open_table(META)
            .expect("meta")
            .insert("schema", SCHEMA_VERSION)
            .expect("the schema");
        tx.open_table(table)
            .expect("a table")
            .insert(key, bytes)
            .expect("a record");
        tx.commit().expect("commit");
    }
    let store = Store::open(&dir).expect("a store written by this schema opens");
    (store, path)
}

/// An error reading a record names the store's file and the record.
fn names_record(e: &StateError, path: &Path, record: &str) {
    let line = e.to_string();
    assert!(matches!(e, StateError::Unreadable { .. }), "{line}");
    assert!(line.contains(&path.display().to_string()), "{line}");
    assert!(line.contains(record), "{line}");
}

fn run_record(bytes: &[u8]) {
    let direct = serde_json::from_slice::<fleet_agent::state::RunRecord>(bytes);
    let (store, path) = store_with(RUNS, RUN, bytes);
    let run = run_id();
    match store.run(&run) {
        Ok(Some(record)) => {
            assert_eq!(Some(&record), direct.as_ref().ok());
            let json = serde_json::to_vec(&record).expect("a record serializes");
            let back: fleet_agent::state::RunRecord =
                serde_json::from_slice(&json).expect("a written record reads back");
            assert_eq!(back, record);
            assert_eq!(store.runs().expect("the runs").len(), 1);
            // Carried on after the restart: a forward move keeps what the record held.
            let next = RunState::Finished;
            match store.transition(&run, next, RunReport::default()) {
                Ok(Some(event)) => {
                    assert!(record.state.may_become(next));
                    assert_eq!((event.run_id.as_str(), event.state), (RUN, next));
                    // Written back under the id it holds (which nothing checks against its key).
                    let now = store
                        .run(&record.run_id)
                        .expect("read again")
                        .expect("there");
                    assert_eq!(now.state, next);
                    assert_eq!((now.workload, now.inputs), (record.workload, record.inputs));
                }
                Ok(None) => assert!(!record.state.may_become(next)),
                Err(e) => panic!("a record that read could not move on: {e}"),
            }
        }
        Ok(None) => panic!("a record that is there was not found"),
        Err(e) => {
            assert!(
                direct.is_err(),
                "the store refused a record that reads: {e}"
            );
            names_record(&e, &path, "run record fuzz");
            let e = store.runs().expect_err("listing meets the same record");
            names_record(&e, &path, "run record fuzz");
        }
    }
}

fn event_record(bytes: &[u8]) {
    let direct = serde_json::from_slice::<Event>(bytes);
    let (store, path) = store_with(EVENTS, 1u64, bytes);
    match store.pending_events(0, 16) {
        Ok(events) => {
            assert_eq!(events.len(), 1);
            assert_eq!(Some(&events[0]), direct.as_ref().ok());
            let json = serde_json::to_vec(&events[0]).expect("an event serializes");
            let back: Event = serde_json::from_slice(&json).expect("a written event reads back");
            assert_eq!(value(&back), value(&events[0]));
        }
        Err(e) => {
            assert!(
                direct.is_err(),
                "the store refused an event that reads: {e}"
            );
            names_record(&e, &path, "event record 1");
        }
    }
    // The coordinator's ack drops it whatever it holds.
    assert_eq!(store.ack_events(1).expect("an ack"), 1);
    assert!(
        store
            .pending_events(0, 16)
            .expect("nothing left")
            .is_empty()
    );
}

fn op_record(bytes: &[u8]) {
    let (store, path) = store_with(OPS, OP, bytes);
    #[derive(serde::Deserialize)]
    struct Recorded {
        result: Answer,
    }
    let direct = serde_json::from_slice::<Recorded>(bytes).map(|r| r.result);
    match store.answer_of(OP) {
        Ok(Some(answer)) => assert_eq!(Some(&answer), direct.as_ref().ok()),
        Ok(None) => panic!("an answer that is there was not found"),
        Err(e) => {
            assert!(
                direct.is_err(),
                "the store refused an answer that reads: {e}"
            );
            names_record(&e, &path, "operation record op-fuzz");
        }
    }
    let (store, path) = store_with(OPS, "run-claim:fuzz", bytes);
    match store.run_claim(&run_id()) {
        Ok(claim) => assert!(claim.is_some()),
        Err(e) => names_record(&e, &path, "operation record run-claim:fuzz"),
    }
}

fn membership(bytes: &[u8]) {
    let dir = fresh_dir("node_records-identity");
    let path = dir.join(identity::MEMBERSHIP_FILE);
    std::fs::write(&path, bytes).expect("write the membership");
    match identity::load_membership(&dir) {
        Ok(Some(m)) => {
            let addresses = m.addresses();
            assert_eq!(addresses[0], m.address);
            assert!(!addresses[1..].contains(&m.address));
            identity::save_membership(&dir, &m).expect("write the membership back");
            let back = identity::load_membership(&dir)
                .expect("a written membership reads")
                .expect("and is there");
            assert_eq!(value(&back), value(&m));
        }
        Ok(None) => panic!("a membership that is there was not found"),
        Err(e) => {
            let line = e.to_string();
            assert!(
                matches!(e, identity::IdentityError::Corrupt { .. }),
                "{line}"
            );
            assert!(line.contains(&path.display().to_string()), "{line}");
        }
    }
}

fn node_key(bytes: &[u8]) {
    let dir = fresh_dir("node_records-key");
    let path = dir.join(identity::KEY_FILE);
    std::fs::write(&path, bytes).expect("write the key");
    // A membership beside it: a key that does not read is never replaced by a new one.
    std::fs::write(dir.join(identity::MEMBERSHIP_FILE), b"{}").expect("write a membership");
    match identity::load_or_create(&dir) {
        Ok(id) => {
            assert_eq!(id.public_key().len(), 32);
            assert_eq!(
                std::fs::read(&path).expect("the key"),
                bytes,
                "a key read is kept"
            );
        }
        Err(e) => {
            let line = e.to_string();
            assert!(line.contains(&path.display().to_string()), "{line}");
        }
    }
}

fn run_result(bytes: &[u8]) {
    let [result, owner] = sections::<2>(bytes, b"\0");
    let root = fresh_dir("node_records-runs");
    let store = run_store::Store::new(&root);
    let id = run_store::RunId::parse(RUN).expect("a run id");
    let dir = store.run_dir(&id);
    std::fs::create_dir_all(&dir).expect("a run folder");
    let path = dir.join(run_store::layout::RESULT_FILE);
    std::fs::write(&path, result).expect("write result.json");
    if !owner.is_empty() {
        std::fs::write(dir.join(run_store::layout::OWNER_FILE), owner).expect("write the owner");
    }
    let read = run_store::state::read_result(&dir, &id);
    let status = store.status(&id);
    match read {
        Ok(Some(r)) => {
            assert_eq!((r.run.as_str(), r.schema), (RUN, run_store::record::SCHEMA));
            let status = status.expect("a run with a result has a state");
            assert!(status.state.is_final());
            assert_eq!(status.result.as_ref(), Some(&r));
            std::fs::write(&path, serde_json::to_vec(&r).expect("a result serializes"))
                .expect("write it back");
            let back = run_store::state::read_result(&dir, &id)
                .expect("a written result reads")
                .expect("and is there");
            assert_eq!(back, r);
        }
        Ok(None) => panic!("a result that is there was not found"),
        Err(e) => {
            let line = e.to_string();
            assert!(line.contains(&path.display().to_string()), "{line}");
            let e = status.expect_err("the state of a run with a torn result");
            assert!(e.to_string().contains(&path.display().to_string()));
        }
    }
}

/// Runs `f` with panics unwinding quietly, as in the agent's builds (a fuzzer's hook would stop
/// the process at the panic, before the store's own catch).
fn unwinding<T>(f: impl FnOnce() -> T) -> T {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    std::panic::set_hook(hook);
    match out {
        Ok(out) => out,
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

fn store_file(bytes: &[u8]) {
    let dir = fresh_dir("node_records-file");
    let path = dir.join(FILE_NAME);
    std::fs::write(&path, bytes).expect("write agent.redb");
    let store = match unwinding(|| Store::open(&dir)) {
        Ok(store) => store,
        Err(e) => {
            let line = e.to_string();
            assert!(line.contains(&path.display().to_string()), "{line}");
            return;
        }
    };
    // Whatever it holds, each read is a value or an error naming the file.
    let named = |e: StateError| {
        let line = e.to_string();
        assert!(line.contains(&path.display().to_string()), "{line}");
    };
    let _ = store.generation().map_err(named);
    let _ = store.last_event_id().map_err(named);
    let _ = store.runs().map_err(named);
    let _ = store.pending_events(0, 64).map_err(named);
    let _ = store.answer_of(OP).map_err(named);
}
