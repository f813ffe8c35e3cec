//! Tests: store_postgres. The coordinator's PostgreSQL store against a real PostgreSQL from
//! Debian's packages, in a throwaway cluster per test: the whole store conformance suite, tokens
//! raced from two stores at once, schema versions.
use fleet_coordinator::store::{
    Backend, KEEP_FINAL_RUNS, PostgresBackend, SCHEMA_VERSION, Store, StoreError, TokenRecord,
    conformance,
};
use std::sync::{Arc, Barrier};
use testkit::postgres::Postgres;

fn open(url: &str) -> Store {
    Store::open(
        Box::new(PostgresBackend::open(url).unwrap()),
        KEEP_FINAL_RUNS,
    )
    .unwrap()
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

/// Two stores (as two coordinators) redeem the same token at the same moment with different
/// keys, many times over: each time exactly one joins, and the other is refused.
#[test]
fn a_token_raced_from_two_stores_is_spent_once() {
    let pg = Postgres::start();
    let url = pg.fresh_database();
    let stores = [Arc::new(open(&url)), Arc::new(open(&url))];
    const ROUNDS: usize = 30;
    for round in 0..ROUNDS {
        let token = TokenRecord {
            expires_at_ms: u64::MAX,
            name: None,
            labels: Default::default(),
            spent_by: None,
        };
        let hash = format!("token-{round}");
        stores[0].add_token(&hash, &token, 0).unwrap();
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
                            &format!("n-{round}-{i}"),
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
