//! Tests: store_postgres. The coordinator's PostgreSQL store against a real PostgreSQL from
//! Debian's packages, in a throwaway cluster per test: the whole store conformance suite, tokens
//! raced from two stores at once, schema versions, an unreachable database, and a fleet served
//! from it end to end.
use fleet_coordinator::store::{
    Backend, KEEP_FINAL_RUNS, PostgresBackend, SCHEMA_VERSION, Store, StoreError, TokenRecord,
    conformance,
};
use fleet_proto::{NodeId, RunId};
use serde_json::Value;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};
use testkit::agent::{Agent, Coordinator, script};
use testkit::postgres::Postgres;

const WAIT: Duration = Duration::from_secs(30);

fn open(url: &str) -> Store {
    Store::open(
        Box::new(PostgresBackend::open(url).unwrap()),
        KEEP_FINAL_RUNS,
    )
    .unwrap()
}

/// An unspent token that never expires.
fn token() -> TokenRecord {
    conformance::token(u64::MAX)
}

fn database_of(url: &str) -> &str {
    url.rsplit('/').next().unwrap()
}

/// Every rule, each on a fresh database of one cluster.
#[test]
fn the_store_conformance_suite_passes_on_postgres() {
    let pg = Postgres::start();
    conformance::run_all(&|| -> Box<dyn Backend> {
        Box::new(PostgresBackend::open(&pg.fresh_database()).expect("a fresh database opens"))
    });
}

/// A heartbeat never waits for a row another transaction holds (a group commit writing in its
/// own order would deadlock with it, and PostgreSQL's detection costs a second each time), and
/// never touches a node's record (a serializable transaction writing it would be redone): while
/// `psql` holds one node's lease and the other node's record, the lease write returns at once
/// with the first node's beat left for the next write, and the second node's lease is written;
/// once the row is free, the next write takes it.
#[test]
fn a_lease_write_passes_a_held_lease_by_and_hands_its_beat_back() {
    use fleet_coordinator::store::Beat;
    let pg = Postgres::start();
    let url = pg.fresh_database();
    let store = open(&url);
    let [held, free] = [NodeId::new("n-held"), NodeId::new("n-free")];
    for (i, node) in [&held, &free].into_iter().enumerate() {
        store.add_token(&format!("t{i}"), &token(), 0).unwrap();
        store
            .redeem(&format!("t{i}"), &format!("ed25519:{i}"), node, 1, 10)
            .unwrap();
    }
    let db = database_of(&url);
    let mut holder = pg.sql_started(
        db,
        "BEGIN; SELECT node_id FROM leases WHERE node_id = 'n-held' FOR UPDATE;
         SELECT id FROM nodes WHERE id = 'n-free' FOR UPDATE; SELECT pg_sleep(8); COMMIT;",
    );
    // Its sleep runs once the row is taken.
    let sleeping = "SELECT count(*) FROM pg_stat_activity WHERE query LIKE '%pg_sleep(8)%' \
                    AND state = 'active' AND pid <> pg_backend_pid()";
    let holding = testkit::agent::wait_until(WAIT, || pg.sql(db, sleeping).trim() != "0");
    assert!(holding, "psql took the row");
    let beat = |node: &NodeId| Beat {
        node_id: node.clone(),
        at_ms: Some(50),
        lease_until_ms: 50_000,
    };
    let started = std::time::Instant::now();
    let left = store.write_leases(&[beat(&held), beat(&free)]).unwrap();
    // Waiting, it would have taken the rest of the holder's 8 s.
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the write waited {:?}",
        started.elapsed()
    );
    let left: Vec<&str> = left.iter().map(|b| b.node_id.as_str()).collect();
    assert_eq!(left, ["n-held"]);
    assert_eq!(store.node(&free).unwrap().unwrap().lease_until_ms, 50_000);
    assert_ne!(store.node(&held).unwrap().unwrap().lease_until_ms, 50_000);
    assert!(holder.wait().unwrap().success());
    assert!(store.write_leases(&[beat(&held)]).unwrap().is_empty());
    assert_eq!(store.node(&held).unwrap().unwrap().lease_until_ms, 50_000);
}

/// A set is placed without a serializable snapshot (a set of 30 000 runs would otherwise never
/// commit beside a busy fleet), yet a drain under way is never passed by it: while `psql` drains
/// the node as `drain` does (its record, then the node-change count) and has not committed, the
/// set waits for it, then is refused naming the node, and records nothing.
#[test]
fn a_set_placed_while_a_drain_commits_is_refused_for_the_drained_node() {
    let pg = Postgres::start();
    let url = pg.fresh_database();
    let store = open(&url);
    let node = NodeId::new("n-a");
    store.add_token("t", &token(), 0).unwrap();
    store
        .redeem("t", "ed25519:a", &node, 1, u64::MAX / 2)
        .unwrap();
    let db = database_of(&url);
    let mut drain = pg.sql_started(
        db,
        "BEGIN;
         UPDATE nodes SET record = jsonb_set(record, '{drained_since_ms}', '5') WHERE id = 'n-a';
         INSERT INTO meta (key, value) VALUES ('node_ends', 1)
             ON CONFLICT (key) DO UPDATE SET value = meta.value + 1;
         SELECT pg_sleep(3); COMMIT;",
    );
    let sleeping = "SELECT count(*) FROM pg_stat_activity WHERE query LIKE '%pg_sleep(3)%' \
                    AND state = 'active' AND pid <> pg_backend_pid()";
    assert!(
        testkit::agent::wait_until(WAIT, || pg.sql(db, sleeping).trim() != "0"),
        "psql began the drain"
    );
    let run = conformance::run("r-1", "s-1", "n-a", b"p", 10);
    let e = store.create_set(&"s-1".into(), &[run]).unwrap_err();
    assert!(drain.wait().unwrap().success());
    assert!(
        matches!(&e, StoreError::Refused(why) if why == "the node n-a is draining: it takes no new run"),
        "{e}"
    );
    assert!(store.set_runs(&"s-1".into()).unwrap().is_none());
    assert!(store.run(&RunId::parse("r-1").unwrap()).unwrap().is_none());
}

/// Two stores (as two coordinators) redeem the same token at the same moment with different
/// keys, many times over: each time exactly one joins, and the other is refused.
#[test]
fn a_token_raced_from_two_stores_is_spent_once() {
    let pg = Postgres::start();
    let url = pg.fresh_database();
    let stores = [Arc::new(open(&url)), Arc::new(open(&url))];
    const ROUNDS: usize = 30;
    for round in 0..ROUNDS {
        let hash = format!("token-{round}");
        stores[0].add_token(&hash, &token(), 0).unwrap();
        let barrier = Arc::new(Barrier::new(2));
        let racers: Vec<_> = stores
            .iter()
            .enumerate()
            .map(|(i, store)| {
                let (store, barrier, hash) = (store.clone(), barrier.clone(), hash.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    store
                        .redeem(
                            &hash,
                            &format!("ed25519:key-{round}-{i}"),
                            &NodeId::new(format!("n-{round}-{i}")),
                            1,
                            1_000,
                        )
                        .expect("a race ends in an answer, not an error")
                })
            })
            .collect();
        let answers: Vec<_> = racers.into_iter().map(|r| r.join().unwrap()).collect();
        let joined: Vec<_> = answers.iter().flatten().collect();
        assert_eq!(joined.len(), 1, "round {round}: one join, got {answers:?}");
        assert!(joined[0].first);
    }
    let nodes = pg.sql(database_of(&url), "SELECT count(*) FROM nodes");
    assert_eq!(nodes.trim(), ROUNDS.to_string(), "one node per token");
}

/// Many nodes' runs finishing at once all land (any serialization conflict tried again): 16
/// threads, the pool's size, each finishing its node's runs one transaction at a time; each
/// node's retention then holds exactly its newest `KEEP` final runs and no run is left active.
#[test]
fn runs_finished_by_many_nodes_at_once_all_land() {
    use fleet_coordinator::store::NodeEvent;
    use fleet_proto::run::{Event, RunReport, RunState};
    const NODES: usize = 16;
    const RUNS: usize = 25;
    const KEEP: u64 = 10;
    let pg = Postgres::start();
    let url = pg.fresh_database();
    let store =
        Arc::new(Store::open(Box::new(PostgresBackend::open(&url).unwrap()), KEEP).unwrap());
    let mut runs = Vec::new();
    for n in 0..NODES {
        let (hash, node) = (format!("t{n}"), NodeId::new(format!("n{n}")));
        store.add_token(&hash, &token(), 0).unwrap();
        store
            .redeem(&hash, &format!("ed25519:{n}"), &node, 1, 10)
            .unwrap();
        runs.extend(
            (0..RUNS).map(|r| conformance::run(&format!("r{n}-{r}"), "s", node.as_str(), b"p", 1)),
        );
    }
    store.create_set(&"s".into(), &runs).unwrap();
    let barrier = Arc::new(Barrier::new(NODES));
    let nodes: Vec<_> = (0..NODES)
        .map(|n| {
            let (store, barrier) = (store.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                for r in 0..RUNS {
                    let finished = NodeEvent::Known(Event {
                        id: r as u64 + 1,
                        run_id: RunId::parse(&format!("r{n}-{r}")).unwrap(),
                        state: RunState::Finished,
                        report: RunReport::default(),
                        at_unix_ms: 5,
                    });
                    store
                        .apply_events(&NodeId::new(format!("n{n}")), &[finished])
                        .unwrap_or_else(|e| panic!("node {n}, run {r}: {e}"));
                }
            })
        })
        .collect();
    for node in nodes {
        node.join().unwrap();
    }
    assert!(store.active_runs().unwrap().is_empty());
    for n in 0..NODES {
        let node = NodeId::new(format!("n{n}"));
        assert_eq!(store.read(|tx| tx.final_count(&node)).unwrap(), KEEP);
    }
    let db = database_of(&url);
    let kept = (NODES as u64 * KEEP).to_string();
    assert_eq!(pg.sql(db, "SELECT count(*) FROM runs").trim(), kept);
    assert_eq!(
        pg.sql(db, "SELECT cardinality(run_ids) FROM sets").trim(),
        kept
    );
    assert_eq!(pg.sql(db, "SELECT refs FROM program_refs").trim(), kept);
}

/// Coordinators starting together on a blank database lay it out once, and all open it.
#[test]
fn stores_opened_at_once_on_a_blank_database_lay_it_out_once() {
    let pg = Postgres::start();
    let url = pg.fresh_database();
    let barrier = Arc::new(Barrier::new(4));
    let openers: Vec<_> = (0..4)
        .map(|_| {
            let (url, barrier) = (url.clone(), barrier.clone());
            std::thread::spawn(move || {
                let backend = PostgresBackend::open(&url).unwrap();
                barrier.wait();
                Store::open(Box::new(backend), KEEP_FINAL_RUNS).map(drop)
            })
        })
        .collect();
    for opener in openers {
        opener
            .join()
            .unwrap()
            .expect("every coordinator opens the store");
    }
    let version = pg.sql(database_of(&url), "SELECT value FROM meta");
    assert_eq!(version.trim(), SCHEMA_VERSION.to_string());
}

/// A store a newer coordinator migrated is refused in one line naming the database (without a
/// password) and both versions, and left as it is; so is a database of something else.
#[test]
fn a_newer_schema_or_a_foreign_database_is_refused_and_left_alone() {
    let pg = Postgres::start();
    let url = pg.fresh_database();
    let db = database_of(&url).to_string();
    drop(open(&url));
    pg.sql(
        &db,
        &format!("UPDATE meta SET value = {}", SCHEMA_VERSION + 1),
    );
    let err = Store::open(
        Box::new(PostgresBackend::open(&url).unwrap()),
        KEEP_FINAL_RUNS,
    )
    .err()
    .expect("a newer schema is refused");
    conformance::assert_newer_schema_refused(&err.to_string(), &url);
    assert_eq!(
        pg.sql(&db, "SELECT value FROM meta").trim(),
        (SCHEMA_VERSION + 1).to_string(),
        "left as it was"
    );

    let foreign = pg.fresh_database();
    let foreign_db = database_of(&foreign).to_string();
    pg.sql(&foreign_db, "CREATE TABLE invoices (id int)");
    let err = Store::open(
        Box::new(PostgresBackend::open(&foreign).unwrap()),
        KEEP_FINAL_RUNS,
    )
    .err()
    .expect("a foreign database is refused");
    assert!(
        matches!(&err, StoreError::Schema { found: None, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("not a coordinator store"), "{err}");
    assert_eq!(
        pg.sql(
            &foreign_db,
            "SELECT string_agg(tablename, ',') FROM pg_tables WHERE schemaname = 'public'"
        )
        .trim(),
        "invoices",
        "nothing laid out beside its tables"
    );
}

/// PostgreSQL restarted between two calls: the pooled connections it cut are replaced, and the
/// next calls, reads and writes, go through as if nothing happened.
#[test]
fn a_store_goes_on_after_postgres_restarts() {
    let pg = Postgres::start();
    let url = pg.fresh_database();
    let store = Arc::new(open(&url));
    let token = token();
    // Several connections in the pool, all of them cut by the restart.
    let callers: Vec<_> = (0..4)
        .map(|i| {
            let (store, token) = (store.clone(), token.clone());
            std::thread::spawn(move || store.add_token(&format!("before-{i}"), &token, 0))
        })
        .collect();
    for caller in callers {
        caller.join().unwrap().unwrap();
    }
    pg.restart();
    for i in 0..4 {
        assert!(
            store.has_waiting_token(1).unwrap(),
            "read {i} after the restart"
        );
        store
            .add_token(&format!("after-{i}"), &token, 0)
            .unwrap_or_else(|e| panic!("write {i} after the restart: {e}"));
    }
    let tokens = pg.sql(database_of(&url), "SELECT count(*) FROM tokens");
    assert_eq!(tokens.trim(), "8");
}

/// Over TCP with TLS (rustls on ring): `sslmode=require` with the CA named by `sslrootcert`
/// connects, and the server sees TLS; a certificate no trusted CA signed stops the connection
/// with one line saying which option names the CA; a CA file that cannot be read is named.
#[test]
fn tls_to_postgres_trusts_the_ca_named_by_sslrootcert_only() {
    let pki = testkit::pki::Pki::new();
    let pg = Postgres::start_with_tls(&pki.server_cert, &pki.server_key);
    let db = database_of(&pg.fresh_database()).to_string();
    let tcp = pg.tcp_url(&db);
    let with_ca =
        |ca: &std::path::Path| format!("{tcp}?sslmode=require&sslrootcert={}", ca.display());
    let store = open(&with_ca(&pki.ca_cert));
    store.add_token("t", &token(), 0).unwrap();
    let tls = pg.sql(
        &db,
        "SELECT count(*) FROM pg_stat_ssl JOIN pg_stat_activity USING (pid)
         WHERE ssl AND datname = current_database()",
    );
    assert_eq!(tls.trim(), "1", "the store's pooled connection is TLS");

    for url in [tcp.clone(), with_ca(&pki.other_ca_cert)] {
        let err = PostgresBackend::open(&url)
            .err()
            .expect("an untrusted server");
        assert_eq!(
            err.to_string(),
            format!(
                "cannot connect to the coordinator store {url}: error performing TLS handshake: invalid peer certificate: UnknownIssuer: trust the CA that signed the server's certificate with ?sslrootcert=FILE (PEM)"
            )
        );
    }
    let missing = format!("{tcp}?sslrootcert=/nonexistent/ca.pem");
    let err = PostgresBackend::open(&missing)
        .err()
        .expect("a missing CA file");
    assert_eq!(
        err.to_string(),
        format!(
            "the coordinator store URL {missing} cannot be used: cannot read sslrootcert /nonexistent/ca.pem (No such file or directory (os error 2)): name the CA's PEM file"
        )
    );
}

/// A database nobody answers for stops `serve` (and an operator command) at once, with one line
/// that names the URL without its password.
#[test]
fn an_unreachable_database_is_one_line_without_the_password() {
    let dir = testkit::tempdir();
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let url = format!("postgres://fleet:hunter2@127.0.0.1:{port}/fleet");
    let expected = format!(
        "fleet-coordinator: cannot connect to the coordinator store postgres://fleet:***@127.0.0.1:{port}/fleet: error connecting to server: Connection refused (os error 111): check that PostgreSQL runs there and that the URL's host, user, password and database are right"
    );
    for args in [&["serve", "--listen", "127.0.0.1:0"][..], &["nodes"][..]] {
        let err = testkit::fails(
            testkit::cmd("fleet-coordinator")
                .arg("--data")
                .arg(dir.path().join("coord"))
                .args(["--store", &url])
                .args(args),
        );
        assert_eq!(err.trim_end(), expected, "{args:?}");
        assert!(!err.contains("hunter2"), "{err}");
    }
    let err = testkit::fails(
        testkit::cmd("fleet-coordinator")
            .arg("--data")
            .arg(dir.path().join("coord"))
            .args(["--store", "mysql://fleet:hunter2@db/fleet", "nodes"]),
    );
    assert_eq!(
        err.trim_end(),
        "fleet-coordinator: --store takes a PostgreSQL URL, postgres://USER[:PASSWORD]@HOST[:PORT]/DATABASE, not `mysql://fleet:***@db/fleet`; leave it out for the embedded store in the data directory"
    );
}

/// `serve --store postgres://...`: an agent joins, a run finishes, and the records are in the
/// database (the key in the data folder, no embedded store beside it); with `serve` gone, an
/// operator command given the same `--store` reads them there.
#[test]
fn a_fleet_served_from_postgres_joins_and_finishes_a_run() {
    let pg = Postgres::start();
    let url = pg.fresh_database();
    let dir = testkit::tempdir();
    let data = dir.path().join("coord");
    let mut coord = Coordinator::start(&data, &["--store", &url]);
    let join = dir.path().join("fleet.json");
    std::fs::write(&join, coord.token(&["--name", "worker"])).unwrap();
    let mut agent = Agent::spawn(
        &dir.path().join("agent.log"),
        testkit::agent::machine_command(dir.path()),
    );
    assert!(
        agent.wait_for("session open", 1, WAIT),
        "agent: {}\ncoordinator: {}",
        agent.log_text(),
        coord.log_text()
    );
    let program = script(&dir.path().join("greet.sh"), "echo \"hello $1\"");
    let set = testkit::ok(
        coord
            .command()
            .args(["run", "--all", "--program"])
            .arg(&program)
            .args(["--", "postgres"]),
    );
    let set = set.trim();
    let polled = testkit::ok(
        coord
            .command()
            .args(["status", "--set", set, "--poll", "--json"]),
    );
    let row = serde_json::from_str::<Value>(&polled).unwrap()[0].clone();
    assert_eq!(row["state"], "finished", "{row:#}");
    assert_eq!(row["outcome"]["exit_code"], 0, "{row:#}");

    // A folder no coordinator serves, on the same store: refused in one line before anything is
    // imported, since no coordinator could send its program to a node.
    let stray = dir.path().join("stray");
    let refused = testkit::fails(
        testkit::cmd("fleet-coordinator")
            .arg("--data")
            .arg(&stray)
            .args(["--store", &url, "run", "--all", "--program"])
            .arg(&program),
    );
    assert_eq!(
        refused.trim(),
        format!(
            "fleet-coordinator: no coordinator serves {}: a run's program would stay in this folder, where no coordinator of the fleet can send it to a node; pass the --data folder of a serving coordinator, or start `fleet-coordinator serve` on this one",
            stray.display()
        )
    );
    assert!(testkit::agent::files_under(&stray.join("blobs")).is_empty());

    let db = database_of(&url);
    assert_eq!(pg.sql(db, "SELECT count(*) FROM nodes").trim(), "1");
    assert_eq!(
        pg.sql(db, "SELECT record->>'state' FROM runs").trim(),
        "finished"
    );
    assert!(
        data.join(fleet_coordinator::KEY_FILE).exists(),
        "the key stays in the data folder"
    );
    assert!(
        !data.join(fleet_coordinator::STORE_FILE).exists(),
        "no embedded store beside the database"
    );

    agent.kill();
    coord.kill();
    let offline = testkit::ok(
        coord
            .command()
            .args(["--store", &url, "status", "--set", set, "--json"]),
    );
    let row = serde_json::from_str::<Value>(&offline).unwrap()[0].clone();
    assert_eq!(row["state"], "finished", "read from the database: {row:#}");
}

/// A database laid out by schema 1 (one fleet-wide final order, leases in the node records, the
/// programs table) opens upgraded to the current schema with every record kept where it goes.
#[test]
fn schema_1_database_upgraded_at_open() {
    use fleet_proto::run::RunState;
    let pg = Postgres::start();
    let url = pg.fresh_database();
    PostgresBackend::open(&url).unwrap().create(1).unwrap();
    let waiting = conformance::run("r-wait", "s", "n-a", b"p", 1);
    let mut taken = conformance::run("r-taken", "s", "n-a", b"p", 2);
    taken.accepted = true;
    let mut ended = conformance::run("r-ended", "s", "n-a", b"p", 3);
    ended.state = RunState::Finished;
    let node = serde_json::json!({
        "id": "n-a", "public_key": "ed25519:a", "name": null, "facts": null,
        "joined_at_ms": 1, "last_heartbeat_ms": 7, "lease_until_ms": 9, "generation": 3,
            "last_event_id": 5
    });
    let mut sql = format!("INSERT INTO nodes (id, record) VALUES ('n-a', '{node}');");
    for run in [&waiting, &taken, &ended] {
        let record = serde_json::to_string(run).unwrap();
        sql += &format!(
            "INSERT INTO runs (id, node_id, record) VALUES ('{}', 'n-a', '{record}');",
            run.id
        );
    }
    sql += "INSERT INTO active_runs VALUES ('r-wait', 'n-a'), ('r-taken', 'n-a');
            INSERT INTO final_runs (run_id) VALUES ('r-ended');
            INSERT INTO programs VALUES ('sha256:00', '');";
    let db = database_of(&url);
    pg.sql(db, &sql);
    let store = open(&url);
    // Schema 3's table is there: the first key is recorded.
    assert_eq!(store.claim_fleet_key("ed25519:k").unwrap(), "ed25519:k");
    let waiting_ids: Vec<RunId> = (store.waiting_runs(&"n-a".into()).unwrap())
        .into_iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(waiting_ids, ["r-wait"]);
    assert_eq!(store.active_runs().unwrap().len(), 2);
    assert_eq!(store.read(|tx| tx.final_count(&"n-a".into())).unwrap(), 1);
    let node = store.node(&"n-a".into()).unwrap().unwrap();
    assert_eq!(
        (
            node.last_heartbeat_ms,
            node.lease_until_ms,
            node.generation,
            node.last_event_id
        ),
        (Some(7), 9, 3, 5)
    );
    assert_eq!(
        pg.sql(db, "SELECT value FROM meta WHERE key = 'schema_version'")
            .trim(),
        SCHEMA_VERSION.to_string()
    );
    assert_eq!(
        pg.sql(db, "SELECT to_regclass('programs') IS NULL").trim(),
        "t"
    );
    // The tables rewritten all the time keep room in each page for a row's next version.
    let roomy = "SELECT string_agg(relname || ' ' || array_to_string(reloptions, ','), '; ' ORDER BY relname)
                 FROM pg_class WHERE relname IN ('nodes', 'runs', 'leases', 'event_marks')";
    assert_eq!(
        pg.sql(db, roomy).trim(),
        "event_marks fillfactor=50; leases fillfactor=50; nodes fillfactor=50; runs fillfactor=50"
    );
}

/// A large set has the queue's tables measured again as it commits: a node's queue, read first
/// while they were empty (the server then caches a plan made for empty tables), is read by the
/// indexes once they hold 20 000 runs, not by scanning them (65 ms a read at 100 000 runs, where
/// the index takes 0.2 ms).
#[test]
fn a_queue_first_read_on_empty_tables_is_read_by_index_once_they_fill() {
    let pg = Postgres::start();
    let url = pg.fresh_database();
    let db = database_of(&url);
    let store = open(&url);
    let node = NodeId::new("n0");
    store.add_token("t0", &token(), 0).unwrap();
    store.redeem("t0", "ed25519:0", &node, 1, 10).unwrap();
    for _ in 0..8 {
        assert!(store.waiting_runs(&node).unwrap().is_empty());
    }
    store
        .create_set(&"s".into(), &[conformance::run("r0", "s", "n0", b"p", 1)])
        .unwrap();
    let filler: Vec<_> = (0..20_000)
        .map(|i| conformance::run(&format!("f{i}"), "big", &format!("m{i}"), b"p", 1))
        .collect();
    store.create_set(&"big".into(), &filler).unwrap();
    // Scans of the queue's tables, as the server counts them once each backend reports.
    let scans = |kind: &str| -> u64 {
        let sql = format!(
            "SELECT sum({kind}_scan) FROM pg_stat_user_tables
             WHERE relname IN ('runs', 'waiting_runs', 'active_runs')"
        );
        pg.sql(db, &sql).trim().parse().unwrap_or(0)
    };
    // Both counts once nothing changed them for longer than a backend may hold what it counted
    // (it reports at most once a second, and within 10 s of going idle; a busy machine is late).
    let settled = || {
        let (mut last, mut still_since) = ((scans("seq"), scans("idx")), Instant::now());
        let began = Instant::now();
        while still_since.elapsed() < Duration::from_secs(12) && began.elapsed() < WAIT * 4 {
            std::thread::sleep(Duration::from_millis(500));
            let now = (scans("seq"), scans("idx"));
            if now != last {
                (last, still_since) = (now, Instant::now());
            }
        }
        last
    };
    let (seq_before, idx_before) = settled();
    for _ in 0..5 {
        let queue = store.waiting_runs(&node).unwrap();
        assert_eq!(queue.len(), 1);
        assert_eq!(queue[0].id.as_str(), "r0");
    }
    let (seq_after, idx_after) = settled();
    assert!(
        idx_after > idx_before,
        "the store's reads were never reported"
    );
    assert_eq!(seq_after, seq_before, "a queue read scanned a whole table");
}

/// The sweep's look at the planner's statistics: a table that at least doubled since it was last
/// measured is measured again (and named), and not again until it grows that much anew.
#[test]
fn a_table_grown_past_its_last_measure_is_measured_again() {
    let pg = Postgres::start();
    let url = pg.fresh_database();
    let db = database_of(&url);
    let store = open(&url);
    pg.sql(
        db,
        "INSERT INTO final_runs (run_id, node_id)
             SELECT 'f' || i, 'm' || i FROM generate_series(1, 5000) i",
    );
    // psql's changes reach the server's counts as its session ends, or soon after.
    let mut measured = Vec::new();
    let named = testkit::agent::wait_until(WAIT, || {
        measured = store.refresh_statistics().unwrap();
        !measured.is_empty()
    });
    assert!(named, "the grown table was never measured again");
    assert_eq!(measured, ["final_runs"]);
    let last =
        "SELECT last_analyze IS NOT NULL FROM pg_stat_user_tables WHERE relname = 'final_runs'";
    assert_eq!(pg.sql(db, last).trim(), "t");
    assert_eq!(store.refresh_statistics().unwrap(), Vec::<String>::new());
}

/// PostgreSQL's default predicate-lock settings lock a whole table for a transaction that reads
/// 33 of its rows, which a large fleet's group commits do: `serve` says so at WARN with the
/// setting to change, and says nothing once the server's threshold is high enough.
#[test]
fn serve_advises_the_predicate_lock_setting_a_large_fleet_needs() {
    let pg = Postgres::start();
    let dir = testkit::tempdir();
    let advice = "PostgreSQL locks a whole table for a transaction that reads more than";
    let mut coord = Coordinator::start(&dir.path().join("a"), &["--store", &pg.fresh_database()]);
    let log = coord.log_text();
    let line = log
        .lines()
        .find(|l| l.contains(advice))
        .unwrap_or_else(|| panic!("{log}"));
    assert!(line.contains("WARN"), "{line}");
    assert!(
        line.contains(
            "more than 32 of its rows (max_pred_locks_per_transaction = 64, max_pred_locks_per_relation = -2)"
        ) && line.contains("set max_pred_locks_per_transaction = 4096 in postgresql.conf and restart PostgreSQL"),
        "{line}"
    );
    coord.kill();
    pg.sql(
        "postgres",
        "ALTER SYSTEM SET max_pred_locks_per_relation = 2048",
    );
    pg.sql("postgres", "SELECT pg_reload_conf()");
    let coord = Coordinator::start(&dir.path().join("b"), &["--store", &pg.fresh_database()]);
    let log = coord.log_text();
    assert!(log.contains("coordinator serving"), "{log}");
    assert!(!log.contains(advice), "{log}");
}
