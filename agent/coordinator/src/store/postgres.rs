//! The shared backend: one PostgreSQL database, one table per record kind, records as JSONB with
//! the keys that are looked up by (run by node, the final order) as real, indexed columns.
//!
//! The driver is the sync `postgres` crate (tokio-postgres under its own small runtime per
//! connection) over rustls with the ring provider, so nothing of OpenSSL or aws-lc is linked.
//! Writes run at SERIALIZABLE and are tried again on a serialization failure or a deadlock
//! (SQLSTATE 40001, 40P01); reads run on one REPEATABLE READ snapshot. Connections are kept in a
//! small pool. Every call blocks: async code reaches the store through `spawn_blocking`.
use super::{
    ActiveRun, Backend, Beat, DispatchView, FleetEntry, Layout, NodeBrief, NodeRecord, ReadTx,
    RunRow, SCHEMA_VERSION, StoreError, StoreResult, TokenRecord, WriteTx, capacity_of, run_exists,
    stored_run_id,
};
use fleet_proto::{Digest, NodeId, RunId, SetId};
use postgres::config::Host;
use postgres::error::SqlState;
use postgres::types::{Json, ToSql};
use postgres::{Client, GenericClient, Row, Statement};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;
use tokio_postgres_rustls::MakeRustlsConnect;

/// The schema, one migration per version: version N is reached by applying the first N in order.
const MIGRATIONS: &[&str] = &[
    // 1: the records of `SCHEMA_VERSION` 1.
    "CREATE TABLE meta (key text PRIMARY KEY, value bigint NOT NULL);
     CREATE TABLE tokens (hash text PRIMARY KEY, record jsonb NOT NULL);
     CREATE TABLE nodes (id text PRIMARY KEY, record jsonb NOT NULL);
     CREATE TABLE programs (digest text PRIMARY KEY, bytes bytea NOT NULL);
     CREATE TABLE program_refs (digest text PRIMARY KEY, refs bigint NOT NULL);
     CREATE TABLE runs (id text PRIMARY KEY, node_id text NOT NULL, record jsonb NOT NULL);
     CREATE TABLE sets (id text PRIMARY KEY, run_ids text[] NOT NULL);
     CREATE TABLE active_runs (run_id text PRIMARY KEY, node_id text NOT NULL);
     CREATE INDEX active_runs_by_node ON active_runs (node_id);
     CREATE TABLE final_runs (seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, run_id text NOT NULL);",
    // 2: retention per node, a waiting index per node, the lease in columns of its own (a
    // heartbeat writes only them), and the emptied programs table gone.
    "ALTER TABLE nodes ADD COLUMN last_heartbeat_ms bigint,
                       ADD COLUMN lease_until_ms bigint NOT NULL DEFAULT 0;
     UPDATE nodes SET last_heartbeat_ms = (record->>'last_heartbeat_ms')::bigint,
                      lease_until_ms = (record->>'lease_until_ms')::bigint;
     CREATE TABLE waiting_runs (node_id text NOT NULL, run_id text NOT NULL,
                                PRIMARY KEY (node_id, run_id));
     INSERT INTO waiting_runs (node_id, run_id)
         SELECT a.node_id, a.run_id FROM active_runs a JOIN runs r ON r.id = a.run_id
         WHERE NOT (r.record->>'accepted')::boolean;
     ALTER TABLE final_runs ADD COLUMN node_id text;
     UPDATE final_runs f SET node_id = r.node_id FROM runs r WHERE r.id = f.run_id;
     DELETE FROM final_runs WHERE node_id IS NULL;
     ALTER TABLE final_runs ALTER COLUMN node_id SET NOT NULL;
     CREATE INDEX final_runs_by_node ON final_runs (node_id, seq);
     DROP TABLE programs;
     CREATE TABLE coordinators (address text PRIMARY KEY, seen_ms bigint NOT NULL);
     CREATE TABLE event_marks (node_id text PRIMARY KEY, last_event_id bigint NOT NULL);
     INSERT INTO event_marks (node_id, last_event_id)
         SELECT id, (record->>'last_event_id')::bigint FROM nodes
         WHERE (record->>'last_event_id')::bigint > 0;",
    // 3: the fleet's public key, so a coordinator with another key is refused.
    "CREATE TABLE fleet (key text PRIMARY KEY, value text NOT NULL);",
    // 4: the lease in a table of its own: a heartbeat never updates the row that a serializable
    // transaction on the node's record writes, so neither is redone for the other.
    "CREATE TABLE leases (node_id text PRIMARY KEY, last_heartbeat_ms bigint,
                          lease_until_ms bigint NOT NULL);
     INSERT INTO leases (node_id, last_heartbeat_ms, lease_until_ms)
         SELECT id, last_heartbeat_ms, lease_until_ms FROM nodes;
     ALTER TABLE nodes DROP COLUMN last_heartbeat_ms, DROP COLUMN lease_until_ms;",
];

const _: () = assert!(MIGRATIONS.len() as u64 == SCHEMA_VERSION);

/// Room left in each page of the tables whose rows are rewritten all the time, so a new version of
/// a row fits beside the old one and no index is written (a HOT update). A serializable
/// transaction that wrote an index page conflicted with every one that had read it: 60% of node
/// record updates and 55% of run updates wrote their index in a 30 000-node rolling restart.
/// Set as a store is laid out or upgraded; storage only, so not a schema version of its own.
const ROOMY_TABLES: &str = "ALTER TABLE nodes SET (fillfactor = 50);
     ALTER TABLE runs SET (fillfactor = 50);
     ALTER TABLE leases SET (fillfactor = 50);
     ALTER TABLE event_marks SET (fillfactor = 50);";

/// Held (per database) while a store is laid out, so coordinators starting at once take turns.
const MIGRATION_LOCK: i64 = 0x666c_6565_7473_746f; // "fleetsto"

/// A write that keeps meeting conflicts is tried again for this long: on a busy machine the
/// transactions take longer and overlap more, so patience is measured in time, not in tries.
const WRITE_PATIENCE: Duration = Duration::from_secs(60);
/// How long a group commit's batch is tried again before it is split (`Backend::write_batch`):
/// with 30 000 nodes moving between coordinators, a batch of 512 redone whole failed 78 times
/// over 52 s while its coordinator opened no session (BENCHMARKS.md).
const BATCH_PATIENCE: Duration = Duration::from_secs(3);
/// The longest pause between two tries of a write; each pause is random up to the cap, which
/// doubles from 1 ms, so transactions that met stop meeting.
const WRITE_BACKOFF_CAP: Duration = Duration::from_millis(250);

/// A write tried again for this long or longer is logged: the store's writers are meeting.
const SLOW_WRITE: Duration = Duration::from_secs(1);

/// A set of this many runs or more has the queue's tables measured again as it commits.
const BULK_RUNS: usize = 1000;

/// Fresh statistics for the tables a dispatch reads: the server's cached plans for them are made
/// again. Until autovacuum looks (a minute or more), plans made while they were near empty scan
/// them whole: 65 ms a dispatch read at 100 000 runs where the index takes 0.2 ms.
const ANALYZE_QUEUE: &str = "ANALYZE runs, waiting_runs, active_runs";

/// The fleet's tables that at least doubled since last measured (`reltuples` is what the last
/// ANALYZE counted, -1 before the first): growth only, as churn at a steady size (every heartbeat
/// rewrites `leases`) leaves plans right and is autovacuum's to measure.
const GROWN_TABLES: &str = "SELECT s.relname::text FROM pg_stat_user_tables s
     JOIN pg_class c ON c.oid = s.relid
     WHERE s.schemaname = current_schema() AND s.n_live_tup >= greatest(500, 2 * c.reltuples)";

/// A set's rows go in statements of at most this many: tokio-postgres keeps each connection's
/// buffers as large as the largest message it ever sent (30 MiB for a set of 30 000 runs in one).
const RUNS_PER_STATEMENT: usize = 1000;

/// At most this many connections per coordinator.
const POOL_SIZE: usize = 16;

/// The channel a committed [`WriteTx::put_waiting`] notifies, for the other coordinators.
const WAITING_CHANNEL: &str = "fleet_waiting";

/// How long a connection attempt may take when the URL does not say.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// One PostgreSQL database. It holds no rules: see [`super::Store`].
pub struct PostgresBackend {
    config: postgres::Config,
    tls: MakeRustlsConnect,
    /// The URL with its password hidden.
    location: String,
    pool: Mutex<Pool>,
    freed: Condvar,
    /// The connection that listens on [`WAITING_CHANNEL`], once asked to.
    listener: Mutex<Option<Conn>>,
    /// The connection the heartbeats' lease writes take, once made: never one the sessions'
    /// reads hold while 10 000 nodes move in, which can outlast a lease.
    leases: Mutex<Option<Conn>>,
}

#[derive(Default)]
struct Pool {
    idle: Vec<Conn>,
    /// Connections open, idle or in use.
    open: usize,
}

/// A connection and the statements prepared on it.
struct Conn {
    client: Client,
    prepared: HashMap<&'static str, Statement>,
}

/// `url` with the password (in the user part or as a `password=` parameter) replaced by `***`.
pub fn redact(url: &str) -> String {
    let (head, query) = match url.split_once('?') {
        Some((head, query)) => (head, Some(query)),
        None => (url, None),
    };
    let mut out = match head.split_once("://") {
        Some((scheme, rest)) => {
            let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
            let authority = match authority.rsplit_once('@') {
                Some((user_info, host)) => match user_info.split_once(':') {
                    Some((user, _)) => format!("{user}:***@{host}"),
                    None => authority.to_string(),
                },
                None => authority.to_string(),
            };
            format!("{scheme}://{authority}{path}")
        }
        None => head.to_string(),
    };
    if let Some(query) = query {
        let params: Vec<String> = query
            .split('&')
            .map(|param| match param.split_once('=') {
                Some((key, _)) if key.eq_ignore_ascii_case("password") => format!("{key}=***"),
                _ => param.to_string(),
            })
            .collect();
        out.push('?');
        out.push_str(&params.join("&"));
    }
    out
}

/// One line from a driver error and its causes (the driver says only what it was doing; the
/// server's detail and hint come on lines of their own).
fn one_line(e: &postgres::Error) -> String {
    let mut text = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(inner) = cause {
        text.push_str(": ");
        text.push_str(&inner.to_string());
        cause = inner.source();
    }
    text.lines().collect::<Vec<_>>().join("; ")
}

fn fail(e: postgres::Error) -> StoreError {
    match is_cut(&e) {
        true => StoreError::Cut(one_line(&e)),
        false => StoreError::Db(one_line(&e)),
    }
}

/// The server is going away or the connection is gone: the client may not have seen its
/// connection close yet when the error arrives (a shutdown's FATAL comes first).
fn is_cut(e: &postgres::Error) -> bool {
    e.is_closed()
        || matches!(
            e.code(),
            Some(&SqlState::ADMIN_SHUTDOWN)
                | Some(&SqlState::CRASH_SHUTDOWN)
                | Some(&SqlState::CANNOT_CONNECT_NOW)
        )
        || e.code().is_some_and(|code| code.code().starts_with("08"))
}

fn is_conflict(e: &postgres::Error) -> bool {
    matches!(
        e.code(),
        Some(&SqlState::T_R_SERIALIZATION_FAILURE) | Some(&SqlState::T_R_DEADLOCK_DETECTED)
    )
}

/// How many rows of one table a group commit's transaction may read (a batch of 512 changes,
/// each reading its node's rows) before PostgreSQL should promote its locks to the whole table.
const ROWS_A_BATCH_READS: i64 = 1024;
/// What `tuning_advice` suggests: a table lock after 2 048 rows.
const SUGGESTED_PRED_LOCKS: i64 = 4096;

/// The rows of one relation a serializable transaction locks one by one before PostgreSQL locks
/// the relation: `max_pred_locks_per_relation`, or when negative, `max_pred_locks_per_transaction`
/// divided by its magnitude.
fn rows_before_table_lock(per_transaction: i64, per_relation: i64) -> i64 {
    match per_relation {
        n if n >= 0 => n,
        n => per_transaction / -n,
    }
}

impl PostgresBackend {
    /// Connects to the database at `url` (`postgres://USER[:PASSWORD]@HOST[:PORT]/DB[?...]`),
    /// once, so an unreachable database is found at start; what it holds is judged by
    /// [`super::Store::open`].
    pub fn open(url: &str) -> StoreResult<PostgresBackend> {
        let location = redact(url);
        let unusable = |reason: String| StoreError::Url {
            url: location.clone(),
            reason,
        };
        let (url, root_file) = take_param(url, "sslrootcert");
        let mut config: postgres::Config = url.parse().map_err(|e: postgres::Error| {
            unusable(format!(
                "{}: write it as postgres://USER[:PASSWORD]@HOST[:PORT]/DATABASE[?OPTIONS]",
                one_line(&e)
            ))
        })?;
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(CONNECT_TIMEOUT);
        }
        let roots = match root_file {
            Some(file) => roots_in(&file).map_err(unusable)?,
            None => system_roots(),
        };
        let backend = PostgresBackend {
            config,
            tls: MakeRustlsConnect::new(tls_config(roots)),
            location,
            pool: Mutex::new(Pool::default()),
            freed: Condvar::new(),
            listener: Mutex::new(None),
            leases: Mutex::new(None),
        };
        let first = backend.take()?;
        backend.give_back(first);
        Ok(backend)
    }

    /// A new connection (counted by the caller).
    fn dial(&self) -> StoreResult<Conn> {
        // A unix socket has no name to check a certificate against: no TLS there.
        let local = (self.config.get_hosts().iter()).all(|host| matches!(host, Host::Unix(_)));
        let connected = match local {
            true => self.config.connect(postgres::NoTls),
            false => self.config.connect(self.tls.clone()),
        };
        let client = connected.map_err(|e| {
            let reason = one_line(&e);
            // The driver's errors have no public kind; its TLS failures all say this first.
            let hint = match reason.starts_with("error performing TLS handshake") {
                true => "trust the CA that signed the server's certificate with ?sslrootcert=FILE (PEM)",
                false => "check that PostgreSQL runs there and that the URL's host, user, password and database are right",
            };
            StoreError::Unreachable {
                url: self.location.clone(),
                reason,
                hint,
            }
        })?;
        Ok(Conn {
            client,
            prepared: HashMap::new(),
        })
    }

    /// An idle connection, a new one while fewer than [`POOL_SIZE`] are open, or the next one
    /// given back.
    fn take(&self) -> StoreResult<Conn> {
        let mut pool = self
            .pool
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        loop {
            if let Some(conn) = pool.idle.pop() {
                if !conn.client.is_closed() {
                    return Ok(conn);
                }
                pool.open -= 1;
                continue;
            }
            if pool.open < POOL_SIZE {
                pool.open += 1;
                drop(pool);
                let dialed = self.dial();
                if dialed.is_err() {
                    self.pool
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .open -= 1;
                    self.freed.notify_one();
                }
                return dialed;
            }
            pool = self
                .freed
                .wait(pool)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }

    /// Returns a connection to the pool; a closed one (the server went away) is dropped.
    fn give_back(&self, conn: Conn) {
        let mut pool = self
            .pool
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if conn.client.is_closed() {
            pool.open -= 1;
        } else {
            pool.idle.push(conn);
        }
        self.freed.notify_one();
    }

    /// Runs `f` on a pooled connection. A failure that closed the connection (the server went
    /// away mid-transaction) is [`StoreError::Unreachable`]: nothing of it was committed, or the
    /// commit's answer was lost, and the caller may try again once the server is back.
    fn with_conn<T>(&self, f: impl FnOnce(&mut Conn) -> StoreResult<T>) -> StoreResult<T> {
        let mut conn = self.take()?;
        let out = f(&mut conn);
        let closed = conn.client.is_closed();
        self.give_back(conn);
        let reason = match out {
            Err(StoreError::Db(reason)) if closed => reason,
            Err(StoreError::Cut(reason)) => reason,
            out => return out,
        };
        Err(StoreError::Unreachable {
            url: self.location.clone(),
            reason,
            hint: "the connection closed mid-transaction (the server restarted or went away); it is tried again",
        })
    }
}

impl Drop for PostgresBackend {
    fn drop(&mut self) {
        // A sync client closes on its own runtime, which cannot start inside an async context
        // (where the last owner of a serving coordinator's store may let go): close them on a
        // thread of their own.
        let idle = std::mem::take(
            &mut self
                .pool
                .get_mut()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .idle,
        );
        let listener = self
            .listener
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        let leases = self
            .leases
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        let _ = std::thread::spawn(move || drop((idle, listener, leases))).join();
    }
}

/// `url` without its query parameter `key`, and that parameter's value (the driver refuses
/// options it does not know, and `sslrootcert` is read here).
fn take_param(url: &str, key: &str) -> (String, Option<String>) {
    let Some((head, query)) = url.split_once('?') else {
        return (url.to_string(), None);
    };
    let mut value = None;
    let kept: Vec<&str> = query
        .split('&')
        .filter(|param| match param.split_once('=') {
            Some((k, v)) if k == key => {
                value = Some(v.to_string());
                false
            }
            _ => true,
        })
        .collect();
    match kept.is_empty() {
        true => (head.to_string(), value),
        false => (format!("{head}?{}", kept.join("&")), value),
    }
}

fn system_roots() -> rustls::RootCertStore {
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_native_certs::load_native_certs().certs {
        let _ = roots.add(cert);
    }
    roots
}

/// The certificates of a PEM file, as the only roots (as libpq's `sslrootcert`).
fn roots_in(file: &str) -> Result<rustls::RootCertStore, String> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let pem = std::fs::read(file)
        .map_err(|e| format!("cannot read sslrootcert {file} ({e}): name the CA's PEM file"))?;
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&pem) {
        let added = cert
            .map_err(|e| e.to_string())
            .and_then(|cert| roots.add(cert).map_err(|e| e.to_string()));
        if let Err(e) = added {
            return Err(format!(
                "sslrootcert {file} holds a certificate that cannot be used ({e}): name the CA's PEM file"
            ));
        }
    }
    if roots.is_empty() {
        return Err(format!(
            "sslrootcert {file} holds no PEM certificate: name the CA's PEM file"
        ));
    }
    Ok(roots)
}

/// rustls on the ring provider, trusting `roots` (the system's, or `sslrootcert`'s); rustls
/// always checks the server's certificate and name. A server without TLS is reached in plain
/// text under the default `sslmode=prefer` (`require` refuses it); a unix socket always is.
fn tls_config(roots: rustls::RootCertStore) -> rustls::ClientConfig {
    rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        // Cannot fail: the ring provider supports rustls' default protocol versions.
        .expect("ring supports the default protocol versions")
        .with_root_certificates(roots)
        .with_no_client_auth()
}

/// What the database holds, read through any client or transaction.
fn layout_of(client: &mut impl GenericClient) -> Result<Layout, postgres::Error> {
    let row = client.query_one(
        "SELECT to_regclass('meta') IS NOT NULL,
                EXISTS (SELECT 1 FROM pg_tables WHERE schemaname = current_schema())",
        &[],
    )?;
    let (has_meta, has_tables): (bool, bool) = (row.get(0), row.get(1));
    if !has_meta {
        return Ok(if has_tables {
            Layout::Unversioned
        } else {
            Layout::Blank
        });
    }
    let version = client.query_opt("SELECT value FROM meta WHERE key = 'schema_version'", &[])?;
    Ok(match version {
        Some(row) => Layout::Version(row.get::<_, i64>(0) as u64),
        None => Layout::Unversioned,
    })
}

fn count(value: i64) -> u64 {
    u64::try_from(value).unwrap_or(0)
}

impl Backend for PostgresBackend {
    fn kind(&self) -> &'static str {
        "postgres"
    }

    fn parallel_calls(&self) -> usize {
        // The rest of the pool is left to the group commit and the background loops.
        POOL_SIZE - 4
    }

    fn location(&self) -> String {
        self.location.clone()
    }

    fn layout(&self) -> StoreResult<Layout> {
        self.with_conn(|conn| layout_of(&mut conn.client).map_err(fail))
    }

    /// Applies the migrations up to `version` (those this coordinator knows) and records
    /// `version`, in one transaction under an advisory lock; when another coordinator laid the
    /// store out meanwhile, it is left as that one made it.
    fn create(&self, version: u64) -> StoreResult<()> {
        self.migrate(Layout::Blank, 0, version)
    }

    /// Applies the migrations after `from` up to `to`, in one transaction under the same lock;
    /// when another coordinator upgraded the store meanwhile, it is left as that one made it.
    fn upgrade(&self, from: u64, to: u64) -> StoreResult<()> {
        self.migrate(Layout::Version(from), from, to)
    }

    fn read(&self, f: &mut dyn FnMut(&dyn ReadTx) -> StoreResult<()>) -> StoreResult<()> {
        self.with_conn(|conn| {
            self.begin(conn, "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")?;
            let done = f(&PgTx::new(conn));
            let end = conn.client.batch_execute(match done {
                Ok(()) => "COMMIT",
                Err(_) => "ROLLBACK",
            });
            done.and(end.map_err(fail))
        })
    }

    /// One statement, so one snapshot and one round trip, outside any transaction.
    fn dispatch_view(&self, node_id: &NodeId) -> StoreResult<DispatchView> {
        let id = node_id.as_str();
        let row = self.with_conn(|conn| {
            PgTx::new(conn).query_opt(
                "SELECT n.id, n.record, l.last_heartbeat_ms, l.lease_until_ms, m.last_event_id,
                        ARRAY(SELECT r.record FROM waiting_runs w JOIN runs r ON r.id = w.run_id
                              WHERE w.node_id = $1),
                        (SELECT count(*) FROM active_runs a WHERE a.node_id = $1)
                 FROM (SELECT $1::text AS id) k
                 LEFT JOIN nodes n ON n.id = k.id LEFT JOIN leases l ON l.node_id = k.id
                 LEFT JOIN event_marks m ON m.node_id = k.id",
                &[&id],
            )
        })?;
        let row = row.ok_or_else(|| StoreError::Db("the dispatch view read no row".into()))?;
        let waiting = row
            .try_get::<_, Vec<Json<RunRow>>>(5)
            .map_err(|_| StoreError::Corrupt(format!("the runs waiting for {id}")))?;
        let known = row.get::<_, Option<&str>>(0).is_some();
        Ok(DispatchView {
            waiting: waiting.into_iter().map(|Json(run)| run).collect(),
            out: count(row.get(6)),
            node: known.then(|| node_of(&row)).transpose()?,
        })
    }

    /// One statement at READ COMMITTED: the lease only grows (`GREATEST`), so a heartbeat needs
    /// no serializable snapshot, and takes no predicate lock that would fail other coordinators'
    /// transactions on the nodes table.
    fn write_leases(&self, beats: &[Beat]) -> StoreResult<Vec<Beat>> {
        let touch = |conn: &mut Conn| {
            self.begin(conn, "BEGIN ISOLATION LEVEL READ COMMITTED")?;
            let mut tx = PgTx::new(conn);
            let done = tx.touch_nodes(beats);
            let end = conn.client.batch_execute(match done {
                Ok(_) => "COMMIT",
                Err(_) => "ROLLBACK",
            });
            end.map_err(fail).and(done)
        };
        // The heartbeats' writer and the group commit's leases both write here: the one that
        // finds the lease connection taken writes on a pooled one, never waiting for the other.
        let mut held = match self.leases.try_lock() {
            Ok(held) => held,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return self.with_conn(touch),
        };
        if held.as_ref().is_none_or(|conn| conn.client.is_closed()) {
            *held = Some(self.dial()?);
        }
        // Cannot fail: the branch above put a connection in the slot.
        touch(held.as_mut().expect("connected above"))
    }

    fn wait_for_waiting(&self, timeout: Duration) -> Option<StoreResult<bool>> {
        Some(self.listen(timeout))
    }

    fn refresh_statistics(&self) -> StoreResult<Vec<String>> {
        self.with_conn(|conn| {
            let grown = conn.client.query(GROWN_TABLES, &[]).map_err(fail)?;
            let names: Vec<String> = grown.iter().map(|row| row.get(0)).collect();
            for name in &names {
                let quoted = format!("\"{}\"", name.replace('"', "\"\""));
                conn.client
                    .batch_execute(&format!("ANALYZE {quoted}"))
                    .map_err(fail)?;
            }
            Ok(names)
        })
    }

    fn write(&self, f: &mut dyn FnMut(&mut dyn WriteTx) -> StoreResult<()>) -> StoreResult<()> {
        self.write_at("BEGIN ISOLATION LEVEL SERIALIZABLE", WRITE_PATIENCE, f)
    }

    fn write_batch(
        &self,
        f: &mut dyn FnMut(&mut dyn WriteTx) -> StoreResult<()>,
    ) -> StoreResult<()> {
        self.write_at("BEGIN ISOLATION LEVEL SERIALIZABLE", BATCH_PATIENCE, f)
    }

    /// A serializable transaction that reads more rows of one table than the server's threshold
    /// locks the whole table: every other coordinator's write to it then conflicts and is tried
    /// again (30 000 nodes: writes retried for 44 s, BENCHMARKS.md).
    fn tuning_advice(&self) -> StoreResult<Option<String>> {
        let (per_transaction, per_relation) = self.with_conn(|conn| {
            let row = (conn.client)
                .query_one(
                    "SELECT current_setting('max_pred_locks_per_transaction')::bigint, \
                            current_setting('max_pred_locks_per_relation')::bigint",
                    &[],
                )
                .map_err(fail)?;
            Ok((row.get::<_, i64>(0), row.get::<_, i64>(1)))
        })?;
        let rows = rows_before_table_lock(per_transaction, per_relation);
        Ok((rows < ROWS_A_BATCH_READS).then(|| {
            format!(
                "PostgreSQL locks a whole table for a transaction that reads more than {rows} of its rows (max_pred_locks_per_transaction = {per_transaction}, max_pred_locks_per_relation = {per_relation}): with thousands of nodes, the coordinators' writes fail each other and are tried again; set max_pred_locks_per_transaction = {SUGGESTED_PRED_LOCKS} in postgresql.conf and restart PostgreSQL"
            )
        }))
    }

    /// At READ COMMITTED: each statement sees what committed before it, and the node-change
    /// count held first orders it with every closing transaction (see the trait).
    fn write_placing(
        &self,
        f: &mut dyn FnMut(&mut dyn WriteTx) -> StoreResult<()>,
    ) -> StoreResult<()> {
        self.write_at("BEGIN ISOLATION LEVEL READ COMMITTED", WRITE_PATIENCE, f)
    }
}

impl PostgresBackend {
    /// One transaction begun with `begin`, tried again after a conflict for `patience`.
    fn write_at(
        &self,
        begin: &str,
        patience: Duration,
        f: &mut dyn FnMut(&mut dyn WriteTx) -> StoreResult<()>,
    ) -> StoreResult<()> {
        self.with_conn(|conn| {
            let begun = std::time::Instant::now();
            let mut tries = 0u32;
            loop {
                if tries > 0 {
                    if begun.elapsed() >= patience {
                        return Err(StoreError::Db(format!(
                            "a transaction met conflicting ones for {} s ({tries} tries); try again",
                            patience.as_secs()
                        )));
                    }
                    let cap = (1u64 << tries.min(16)).min(WRITE_BACKOFF_CAP.as_millis() as u64);
                    std::thread::sleep(Duration::from_millis(rand::random::<u64>() % (cap + 1)));
                }
                tries += 1;
                self.begin(conn, begin)?;
                let mut tx = PgTx::new(conn);
                let mut done = (f(&mut tx))
                    .and_then(|()| tx.write_runs())
                    .and_then(|()| tx.write_nodes());
                if done.is_ok() && tx.announce.get() {
                    // Delivered at commit, once per transaction, to every listening coordinator.
                    done = tx.execute("SELECT pg_notify($1, '')", &[&WAITING_CHANNEL]);
                }
                let conflict = tx.conflict.get();
                if conflict || done.is_err() {
                    let _ = conn.client.batch_execute("ROLLBACK");
                    if conflict {
                        continue;
                    }
                    return done;
                }
                // A failed COMMIT ends the transaction too: nothing of it was kept.
                let bulk = tx.bulk.get();
                let committed = conn.client.batch_execute("COMMIT");
                if tries > 1 && begun.elapsed() >= SLOW_WRITE && !committed.as_ref().is_err_and(is_conflict) {
                    tracing::warn!(tries, ms = begun.elapsed().as_millis() as u64, "a write met conflicting transactions and was tried again before it committed");
                }
                match committed {
                    Err(e) if is_conflict(&e) => continue,
                    Ok(()) if bulk => {
                        // Before the sessions read the new queue: plans from before it scan it.
                        if let Err(e) = conn.client.batch_execute(ANALYZE_QUEUE) {
                            tracing::warn!("cannot measure the run tables after a large set: {e}");
                        }
                        return Ok(());
                    }
                    committed => return committed.map_err(fail),
                }
            }
        })
    }
}

impl PostgresBackend {
    /// Waits on the listening connection (made, and made again after the server went away, as
    /// needed) for a notice on [`WAITING_CHANNEL`].
    fn listen(&self, timeout: Duration) -> StoreResult<bool> {
        use postgres::fallible_iterator::FallibleIterator;
        let mut listener = self
            .listener
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if listener.as_ref().is_none_or(|conn| conn.client.is_closed()) {
            let mut conn = self.dial()?;
            conn.client
                .batch_execute(&format!("LISTEN {WAITING_CHANNEL}"))
                .map_err(fail)?;
            *listener = Some(conn);
        }
        // Cannot fail: the branch above put a connection in the slot.
        let conn = listener.as_mut().expect("connected above");
        let mut notices = conn.client.notifications();
        let heard = notices
            .timeout_iter(timeout)
            .next()
            .map_err(fail)?
            .is_some();
        // Take the rest already here without waiting again: one wake-up answers them all.
        while notices.iter().next().map_err(fail)?.is_some() {}
        Ok(heard)
    }

    /// Moves the store from `found` (schema `from`) to schema `to`, unless another coordinator
    /// moved it first.
    fn migrate(&self, found: Layout, from: u64, to: u64) -> StoreResult<()> {
        self.with_conn(|conn| {
            let mut tx = conn.client.transaction().map_err(fail)?;
            tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
                .map_err(fail)?;
            if layout_of(&mut tx).map_err(fail)? != found {
                return tx.commit().map_err(fail);
            }
            for migration in MIGRATIONS.iter().take(to as usize).skip(from as usize) {
                tx.batch_execute(migration).map_err(fail)?;
            }
            // Every table it names exists from the current version on.
            if to >= SCHEMA_VERSION {
                tx.batch_execute(ROOMY_TABLES).map_err(fail)?;
            }
            let version = i64::try_from(to)
                .map_err(|_| StoreError::Refused(format!("schema version {to}")))?;
            tx.execute(
                "INSERT INTO meta (key, value) VALUES ('schema_version', $1)
                 ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value",
                &[&version],
            )
            .map_err(fail)?;
            tx.commit().map_err(fail)
        })
    }

    /// Starts a transaction. A pooled connection that the server closed while it was idle (a
    /// restart) fails here, before anything was done, so it is replaced by a new one, once.
    fn begin(&self, conn: &mut Conn, begin: &str) -> StoreResult<()> {
        match conn.client.batch_execute(begin) {
            Err(_) if conn.client.is_closed() => {
                *conn = self.dial()?;
                conn.client.batch_execute(begin).map_err(fail)
            }
            begun => begun.map_err(fail),
        }
    }
}

/// One transaction, for reads and writes alike; statements are prepared once per connection.
struct PgTx<'a> {
    client: RefCell<&'a mut Client>,
    prepared: RefCell<&'a mut HashMap<&'static str, Statement>>,
    /// A statement failed on a serialization conflict: the whole transaction is tried again.
    conflict: Cell<bool>,
    /// Runs were put in the waiting index: the other coordinators are told at commit.
    announce: Cell<bool>,
    /// A set of [`BULK_RUNS`] or more was put: the queue's tables are measured again at commit.
    bulk: Cell<bool>,
    /// The runs this transaction read or wrote, by id (None: not stored): a batch of changes
    /// reads each run once, and its rules read their own writes here.
    runs: RefCell<HashMap<String, Option<RunRow>>>,
    /// The runs written and not yet sent: all in one statement before commit
    /// ([`PgTx::write_runs`]), not one round trip per change.
    unsent: RefCell<BTreeSet<String>>,
    /// The nodes this transaction read or wrote, as its rules read them (None: not stored): a
    /// batch of 512 session opens reads them in one round trip, not 512.
    nodes: RefCell<HashMap<String, Option<NodeRecord>>>,
    /// What is written to the node tables and not sent yet: a statement per table before
    /// commit ([`PgTx::write_nodes`]), in one order of ids whichever coordinator writes.
    unsent_nodes: RefCell<UnsentNodes>,
}

/// Node writes held until commit, each once per node: the last record, the greatest lease and
/// time heard, the last event id.
#[derive(Default)]
struct UnsentNodes {
    records: BTreeSet<String>,
    leases: BTreeMap<String, (Option<u64>, u64)>,
    marks: BTreeMap<String, u64>,
}

impl UnsentNodes {
    fn is_empty(&self) -> bool {
        self.records.is_empty() && self.leases.is_empty() && self.marks.is_empty()
    }

    /// `node` as it reads once this transaction's writes to it are in.
    fn apply_to(&self, node: &mut NodeRecord) {
        if let Some((heard, lease)) = self.leases.get(node.id.as_str()) {
            node.last_heartbeat_ms = node.last_heartbeat_ms.max(*heard);
            node.lease_until_ms = node.lease_until_ms.max(*lease);
        }
        if let Some(mark) = self.marks.get(node.id.as_str()) {
            node.last_event_id = *mark;
        }
    }
}

type Params<'p> = &'p [&'p (dyn ToSql + Sync)];

impl<'a> PgTx<'a> {
    fn new(conn: &'a mut Conn) -> PgTx<'a> {
        PgTx {
            client: RefCell::new(&mut conn.client),
            prepared: RefCell::new(&mut conn.prepared),
            conflict: Cell::new(false),
            announce: Cell::new(false),
            bulk: Cell::new(false),
            runs: RefCell::default(),
            unsent: RefCell::default(),
            nodes: RefCell::default(),
            unsent_nodes: RefCell::default(),
        }
    }

    /// Sends every node record, lease and event mark written since the last call, a statement
    /// per table.
    fn write_nodes(&self) -> StoreResult<()> {
        let unsent = std::mem::take(&mut *self.unsent_nodes.borrow_mut());
        if unsent.is_empty() {
            return Ok(());
        }
        let nodes = self.nodes.borrow();
        let records: Vec<&NodeRecord> = (unsent.records.iter())
            .filter_map(|id| nodes.get(id).and_then(Option::as_ref))
            .collect();
        if !records.is_empty() {
            let ids: Vec<&str> = records.iter().map(|n| n.id.as_str()).collect();
            let records: Vec<Json<&NodeRecord>> = records.into_iter().map(json).collect();
            self.execute(
                "INSERT INTO nodes (id, record) SELECT * FROM unnest($1::text[], $2::jsonb[])
                 ON CONFLICT (id) DO UPDATE SET record = EXCLUDED.record",
                &[&ids, &records],
            )?;
        }
        if !unsent.leases.is_empty() {
            let ids: Vec<&str> = unsent.leases.keys().map(String::as_str).collect();
            let heard = (unsent.leases.values())
                .map(|(heard, _)| heard.map(bigint).transpose())
                .collect::<StoreResult<Vec<Option<i64>>>>()?;
            let leases = (unsent.leases.values())
                .map(|(_, lease)| bigint(*lease))
                .collect::<StoreResult<Vec<i64>>>()?;
            self.execute(
                "INSERT INTO leases (node_id, last_heartbeat_ms, lease_until_ms)
                 SELECT * FROM unnest($1::text[], $2::bigint[], $3::bigint[])
                 ON CONFLICT (node_id) DO UPDATE SET
                     last_heartbeat_ms = GREATEST(leases.last_heartbeat_ms, EXCLUDED.last_heartbeat_ms),
                     lease_until_ms = GREATEST(leases.lease_until_ms, EXCLUDED.lease_until_ms)",
                &[&ids, &heard, &leases],
            )?;
        }
        if !unsent.marks.is_empty() {
            let ids: Vec<&str> = unsent.marks.keys().map(String::as_str).collect();
            let marks =
                (unsent.marks.values().map(|m| bigint(*m))).collect::<StoreResult<Vec<i64>>>()?;
            self.execute(
                "INSERT INTO event_marks (node_id, last_event_id)
                 SELECT * FROM unnest($1::text[], $2::bigint[])
                 ON CONFLICT (node_id) DO UPDATE SET last_event_id = EXCLUDED.last_event_id",
                &[&ids, &marks],
            )?;
        }
        Ok(())
    }

    /// Reads the nodes under `ids` not read yet into [`PgTx::nodes`], in one round trip.
    fn read_nodes(&self, ids: &[NodeId]) -> StoreResult<()> {
        let keys = not_read(&self.nodes, ids.iter().map(NodeId::as_str));
        if keys.is_empty() {
            return Ok(());
        }
        let rows = self.query(
            "SELECT n.id, n.record, l.last_heartbeat_ms, l.lease_until_ms, m.last_event_id
             FROM nodes n LEFT JOIN leases l ON l.node_id = n.id
             LEFT JOIN event_marks m ON m.node_id = n.id WHERE n.id = ANY($1)",
            &[&keys],
        )?;
        let unsent = self.unsent_nodes.borrow();
        let mut nodes = self.nodes.borrow_mut();
        for key in keys {
            nodes.insert(key.to_string(), None);
        }
        for row in &rows {
            let mut node = node_of(row)?;
            unsent.apply_to(&mut node);
            nodes.insert(node.id.as_str().to_string(), Some(node));
        }
        Ok(())
    }

    /// Sends every run written since the last call, in one statement.
    fn write_runs(&self) -> StoreResult<()> {
        let unsent = std::mem::take(&mut *self.unsent.borrow_mut());
        let runs = self.runs.borrow();
        let rows: Vec<&RunRow> = (unsent.iter())
            .filter_map(|id| runs.get(id).and_then(Option::as_ref))
            .collect();
        if rows.is_empty() {
            return Ok(());
        }
        let ids: Vec<&str> = rows.iter().map(|r| r.id.as_str()).collect();
        let nodes: Vec<&str> = rows.iter().map(|r| r.node_id.as_str()).collect();
        let records: Vec<Json<&RunRow>> = rows.iter().map(|r| json(*r)).collect();
        self.execute(
            "INSERT INTO runs (id, node_id, record)
             SELECT * FROM unnest($1::text[], $2::text[], $3::jsonb[])
             ON CONFLICT (id) DO UPDATE SET node_id = EXCLUDED.node_id, record = EXCLUDED.record",
            &[&ids, &nodes, &records],
        )
    }

    /// Reads the runs under `ids` not read yet into [`PgTx::runs`], in one round trip.
    fn read_runs(&self, ids: &[RunId]) -> StoreResult<()> {
        let keys = not_read(&self.runs, ids.iter().map(RunId::as_str));
        if keys.is_empty() {
            return Ok(());
        }
        let rows = self.query("SELECT id, record FROM runs WHERE id = ANY($1)", &[&keys])?;
        let mut runs = self.runs.borrow_mut();
        for key in keys {
            runs.insert(key.to_string(), None);
        }
        for row in &rows {
            let id: &str = row.get(0);
            runs.insert(id.to_string(), Some(decode(row, 1, id)?));
        }
        Ok(())
    }

    fn check<T>(&self, result: Result<T, postgres::Error>) -> StoreResult<T> {
        result.map_err(|e| {
            self.conflict.set(self.conflict.get() || is_conflict(&e));
            fail(e)
        })
    }

    fn statement(&self, sql: &'static str) -> StoreResult<Statement> {
        if let Some(statement) = self.prepared.borrow().get(sql) {
            return Ok(statement.clone());
        }
        let statement = self.check(self.client.borrow_mut().prepare(sql))?;
        self.prepared.borrow_mut().insert(sql, statement.clone());
        Ok(statement)
    }

    /// New runs' rows in one statement per table.
    fn put_new_runs_at_once(&self, runs: &[RunRow]) -> StoreResult<()> {
        let ids: Vec<&str> = runs.iter().map(|r| r.id.as_str()).collect();
        let nodes: Vec<&str> = runs.iter().map(|r| r.node_id.as_str()).collect();
        let records: Vec<Json<&RunRow>> = runs.iter().map(json).collect();
        let inserted = self.query(
            "INSERT INTO runs (id, node_id, record)
             SELECT * FROM unnest($1::text[], $2::text[], $3::jsonb[])
             ON CONFLICT (id) DO NOTHING RETURNING id",
            &[&ids, &nodes, &records],
        )?;
        // Read back from the server if at all: a copy of every new row would be held to commit.
        let mut known = self.runs.borrow_mut();
        for run in runs {
            known.remove(run.id.as_str());
        }
        drop(known);
        if inserted.len() != runs.len() {
            let mut fresh: std::collections::HashSet<&str> =
                inserted.iter().map(|row| row.get::<_, &str>(0)).collect();
            // Cannot miss: fewer rows came back than went in (a run there before, or twice here).
            let taken = runs.iter().find(|r| !fresh.remove(r.id.as_str()));
            return Err(run_exists(&taken.expect("a run not inserted").id));
        }
        self.execute(
            "INSERT INTO active_runs (run_id, node_id) SELECT * FROM unnest($1::text[], $2::text[])
             ON CONFLICT (run_id) DO UPDATE SET node_id = EXCLUDED.node_id",
            &[&ids, &nodes],
        )?;
        self.announce.set(true);
        self.execute(
            "INSERT INTO waiting_runs (node_id, run_id) SELECT * FROM unnest($1::text[], $2::text[])
             ON CONFLICT DO NOTHING",
            &[&nodes, &ids],
        )
    }

    fn query(&self, sql: &'static str, params: Params) -> StoreResult<Vec<Row>> {
        let statement = self.statement(sql)?;
        self.check(self.client.borrow_mut().query(&statement, params))
    }

    fn query_opt(&self, sql: &'static str, params: Params) -> StoreResult<Option<Row>> {
        let statement = self.statement(sql)?;
        self.check(self.client.borrow_mut().query_opt(&statement, params))
    }

    fn execute(&self, sql: &'static str, params: Params) -> StoreResult<()> {
        let statement = self.statement(sql)?;
        self.check(self.client.borrow_mut().execute(&statement, params))
            .map(drop)
    }

    /// The JSON record in the first column of the row under `key`, if there is one.
    fn record<T: DeserializeOwned>(&self, sql: &'static str, key: &str) -> StoreResult<Option<T>> {
        match self.query_opt(sql, &[&key])? {
            Some(row) => decode(&row, 0, key).map(Some),
            None => Ok(None),
        }
    }
}

/// The keys of `ids` that a transaction's cache of records has not read yet.
fn not_read<'i, T>(
    cache: &RefCell<HashMap<String, Option<T>>>,
    ids: impl Iterator<Item = &'i str>,
) -> Vec<&'i str> {
    let cache = cache.borrow();
    ids.filter(|id| !cache.contains_key(*id)).collect()
}

fn decode<T: DeserializeOwned>(row: &Row, column: usize, key: &str) -> StoreResult<T> {
    row.try_get::<_, Json<T>>(column)
        .map(|Json(value)| value)
        .map_err(|_| StoreError::Corrupt(key.to_string()))
}

fn json<T: Serialize>(value: &T) -> Json<&T> {
    Json(value)
}

impl ReadTx for PgTx<'_> {
    fn token(&self, hash: &str) -> StoreResult<Option<TokenRecord>> {
        self.record("SELECT record FROM tokens WHERE hash = $1", hash)
    }

    fn tokens(&self) -> StoreResult<Vec<(String, TokenRecord)>> {
        let rows = self.query("SELECT hash, record FROM tokens", &[])?;
        rows.iter()
            .map(|row| {
                let hash: String = row.get(0);
                let token = decode(row, 1, &hash)?;
                Ok((hash, token))
            })
            .collect()
    }

    fn node(&self, id: &NodeId) -> StoreResult<Option<NodeRecord>> {
        self.read_nodes(std::slice::from_ref(id))?;
        Ok(self.nodes.borrow().get(id.as_str()).cloned().flatten())
    }

    fn nodes(&self) -> StoreResult<Vec<NodeRecord>> {
        // The whole table is read from the server: this transaction's writes go there first.
        self.write_nodes()?;
        let rows = self.query(
            "SELECT n.id, n.record, l.last_heartbeat_ms, l.lease_until_ms, m.last_event_id
             FROM nodes n LEFT JOIN leases l ON l.node_id = n.id
             LEFT JOIN event_marks m ON m.node_id = n.id",
            &[],
        )?;
        rows.iter().map(node_of).collect()
    }

    fn closed_nodes(&self) -> StoreResult<Vec<NodeRecord>> {
        self.write_nodes()?;
        // A lease and a mark looked up for each closed node only: a join would read (and hold
        // serializable read locks on) every lease, which heartbeats rewrite every second.
        let rows = self.query(
            "SELECT n.id, n.record,
                    (SELECT last_heartbeat_ms FROM leases WHERE node_id = n.id),
                    (SELECT lease_until_ms FROM leases WHERE node_id = n.id),
                    (SELECT last_event_id FROM event_marks WHERE node_id = n.id)
             FROM nodes n
             WHERE n.record->>'drained_since_ms' IS NOT NULL OR n.record->>'ended' IS NOT NULL",
            &[],
        )?;
        rows.iter().map(node_of).collect()
    }

    fn lease_ends(&self) -> StoreResult<Vec<(NodeId, u64)>> {
        // The lease table alone: 30 000 nodes' records with their facts were read every sweep.
        self.write_nodes()?;
        let rows = self.query(
            "SELECT n.id, COALESCE(l.lease_until_ms, 0) FROM nodes n
             LEFT JOIN leases l ON l.node_id = n.id",
            &[],
        )?;
        Ok((rows.iter())
            .map(|row| (NodeId::new(row.get::<_, String>(0)), count(row.get(1))))
            .collect())
    }

    fn node_briefs(&self) -> StoreResult<Vec<NodeBrief>> {
        self.write_nodes()?;
        let rows = self.query(
            "SELECT n.id, COALESCE(l.lease_until_ms, 0),
                    (n.record->'facts'->>'max_runs')::bigint, (n.record->>'capacity')::bigint
             FROM nodes n LEFT JOIN leases l ON l.node_id = n.id",
            &[],
        )?;
        let limit = |v: Option<i64>| v.map(|v| u32::try_from(v).unwrap_or(u32::MAX));
        Ok((rows.iter())
            .map(|row| NodeBrief {
                id: NodeId::new(row.get::<_, String>(0)),
                lease_until_ms: count(row.get(1)),
                capacity: capacity_of(limit(row.get(2)), limit(row.get(3))),
            })
            .collect())
    }

    fn referenced_content(&self) -> StoreResult<Vec<Digest>> {
        let rows = self.query("SELECT digest FROM program_refs WHERE refs > 0", &[])?;
        (rows.iter())
            .map(|row| super::stored_digest(row.get(0)))
            .collect()
    }

    fn program_refs(&self, digest: &Digest) -> StoreResult<u64> {
        let row = self.query_opt(
            "SELECT refs FROM program_refs WHERE digest = $1",
            &[&digest.to_string()],
        )?;
        Ok(row.map_or(0, |row| count(row.get(0))))
    }

    fn run(&self, id: &RunId) -> StoreResult<Option<RunRow>> {
        self.read_runs(std::slice::from_ref(id))?;
        Ok(self.runs.borrow().get(id.as_str()).cloned().flatten())
    }

    fn runs(&self, ids: &[RunId]) -> StoreResult<Vec<RunRow>> {
        // One round trip for a node's whole queue, not one per run.
        self.read_runs(ids)?;
        let runs = self.runs.borrow();
        Ok((ids.iter())
            .filter_map(|id| runs.get(id.as_str()).cloned().flatten())
            .collect())
    }

    fn set(&self, id: &SetId) -> StoreResult<Option<Vec<RunId>>> {
        let row = self.query_opt("SELECT run_ids FROM sets WHERE id = $1", &[&id.as_str()])?;
        let ids = |row: Row| {
            row.get::<_, Vec<&str>>(0)
                .into_iter()
                .map(stored_run_id)
                .collect()
        };
        row.map(ids).transpose()
    }

    fn active(&self, node_id: Option<&NodeId>) -> StoreResult<Vec<RunId>> {
        let rows = match node_id {
            Some(node) => self.query(
                "SELECT run_id FROM active_runs WHERE node_id = $1",
                &[&node.as_str()],
            )?,
            None => self.query("SELECT run_id FROM active_runs", &[])?,
        };
        run_ids(&rows)
    }

    /// Only the brief's fields leave the server: the records' workloads and events stay there.
    fn active_brief(&self) -> StoreResult<Vec<ActiveRun>> {
        let rows = self.query(
            "SELECT r.id, jsonb_build_object('id', r.id, 'node_id', r.record->'node_id',
                        'state', r.record->'state', 'created_ms', r.record->'created_ms',
                        'error', r.record->'error', 'queued_for', r.record->'queued_for')
             FROM active_runs a JOIN runs r ON r.id = a.run_id",
            &[],
        )?;
        (rows.iter())
            .map(|row| decode(row, 1, row.get(0)))
            .collect()
    }

    fn holds_active(&self, node_id: &NodeId) -> StoreResult<bool> {
        let row = self.query_opt(
            "SELECT 1 FROM active_runs WHERE node_id = $1 LIMIT 1",
            &[&node_id.as_str()],
        )?;
        Ok(row.is_some())
    }

    fn waiting(&self, node_id: &NodeId) -> StoreResult<Vec<RunId>> {
        let rows = self.query(
            "SELECT run_id FROM waiting_runs WHERE node_id = $1",
            &[&node_id.as_str()],
        )?;
        run_ids(&rows)
    }

    fn active_counts(&self) -> StoreResult<BTreeMap<NodeId, u64>> {
        let rows = self.query(
            "SELECT node_id, count(*) FROM active_runs GROUP BY node_id",
            &[],
        )?;
        Ok(rows
            .iter()
            .map(|row| (NodeId::new(row.get::<_, String>(0)), count(row.get(1))))
            .collect())
    }

    fn waiting_nodes(&self) -> StoreResult<Vec<NodeId>> {
        let rows = self.query("SELECT DISTINCT node_id FROM waiting_runs", &[])?;
        Ok(rows
            .iter()
            .map(|row| NodeId::new(row.get::<_, String>(0)))
            .collect())
    }

    fn final_count(&self, node_id: &NodeId) -> StoreResult<u64> {
        let row = self.query_opt(
            "SELECT count(*) FROM final_runs WHERE node_id = $1",
            &[&node_id.as_str()],
        )?;
        Ok(row.map_or(0, |row| count(row.get(0))))
    }

    fn coordinators(&self) -> StoreResult<Vec<(String, u64)>> {
        let rows = self.query("SELECT address, seen_ms FROM coordinators", &[])?;
        Ok(rows
            .iter()
            .map(|row| (row.get(0), count(row.get(1))))
            .collect())
    }

    fn node_changes(&self) -> StoreResult<u64> {
        let row = self.query_opt("SELECT value FROM meta WHERE key = 'node_ends'", &[])?;
        Ok(row.map_or(0, |row| count(row.get(0))))
    }

    fn fleet_entry(&self, entry: FleetEntry) -> StoreResult<Option<String>> {
        let row = self.query_opt("SELECT value FROM fleet WHERE key = $1", &[&entry.key()])?;
        Ok(row.map(|row| row.get(0)))
    }
}

/// The run ids in the first column of each row.
fn run_ids(rows: &[Row]) -> StoreResult<Vec<RunId>> {
    rows.iter().map(|row| stored_run_id(row.get(0))).collect()
}

/// A node's record with its heartbeat and lease from their own columns.
fn node_of(row: &Row) -> StoreResult<NodeRecord> {
    let mut node: NodeRecord = decode(row, 1, row.get::<_, &str>(0))?;
    node.last_heartbeat_ms = row.get::<_, Option<i64>>(2).map(count);
    node.lease_until_ms = row.get::<_, Option<i64>>(3).map_or(0, count);
    node.last_event_id = row.get::<_, Option<i64>>(4).map_or(0, count);
    Ok(node)
}

/// A time or count as PostgreSQL's bigint.
fn bigint(value: u64) -> StoreResult<i64> {
    i64::try_from(value).map_err(|_| StoreError::Refused(format!("{value} is past a bigint")))
}

impl WriteTx for PgTx<'_> {
    fn put_token(&mut self, hash: &str, token: &TokenRecord) -> StoreResult<()> {
        self.execute(
            "INSERT INTO tokens (hash, record) VALUES ($1, $2)
             ON CONFLICT (hash) DO UPDATE SET record = EXCLUDED.record",
            &[&hash, &json(token)],
        )
    }

    fn remove_token(&mut self, hash: &str) -> StoreResult<()> {
        self.execute("DELETE FROM tokens WHERE hash = $1", &[&hash])
    }

    fn put_node(&mut self, node: &NodeRecord) -> StoreResult<()> {
        let id = node.id.as_str().to_string();
        let mut kept = node.clone();
        self.unsent_nodes.borrow().apply_to(&mut kept);
        self.nodes.borrow_mut().insert(id.clone(), Some(kept));
        self.unsent_nodes.borrow_mut().records.insert(id);
        Ok(())
    }

    fn put_lease(
        &mut self,
        node_id: &NodeId,
        heard_ms: Option<u64>,
        lease_until_ms: u64,
    ) -> StoreResult<()> {
        bigint(lease_until_ms)?;
        heard_ms.map(bigint).transpose()?;
        let mut unsent = self.unsent_nodes.borrow_mut();
        let held = (unsent.leases)
            .entry(node_id.as_str().to_string())
            .or_insert((heard_ms, lease_until_ms));
        *held = (held.0.max(heard_ms), held.1.max(lease_until_ms));
        if let Some(Some(node)) = self.nodes.borrow_mut().get_mut(node_id.as_str()) {
            unsent.apply_to(node);
        }
        Ok(())
    }

    fn set_last_event_id(&mut self, node_id: &NodeId, id: u64) -> StoreResult<()> {
        bigint(id)?;
        let mut unsent = self.unsent_nodes.borrow_mut();
        unsent.marks.insert(node_id.as_str().to_string(), id);
        if let Some(Some(node)) = self.nodes.borrow_mut().get_mut(node_id.as_str()) {
            unsent.apply_to(node);
        }
        Ok(())
    }

    fn touch_nodes(&mut self, beats: &[Beat]) -> StoreResult<Vec<Beat>> {
        // Written on the server apart from the held writes: those go first, and what this
        // transaction read of these nodes is read again.
        self.write_nodes()?;
        {
            let mut nodes = self.nodes.borrow_mut();
            for beat in beats {
                nodes.remove(beat.node_id.as_str());
            }
        }
        // One row per node, the greatest of its beats (an UPDATE meets a row once), in id order.
        let mut merged: BTreeMap<&str, (Option<u64>, u64)> = BTreeMap::new();
        for b in beats {
            let held = merged.entry(b.node_id.as_str()).or_insert((b.at_ms, 0));
            *held = (held.0.max(b.at_ms), held.1.max(b.lease_until_ms));
        }
        let ids: Vec<&str> = merged.keys().copied().collect();
        let heard = (merged
            .values()
            .map(|(heard, _)| heard.map(bigint).transpose()))
        .collect::<StoreResult<Vec<Option<i64>>>>()?;
        let leases =
            (merged.values().map(|(_, lease)| bigint(*lease))).collect::<StoreResult<Vec<_>>>()?;
        // One statement for the whole batch. It never waits for a row: a group commit writing
        // node records in its own order would deadlock with it (a second lost to detection
        // each time). The rows it skipped come back: those nodes' beats go with the next write.
        let busy = self.query(
            "WITH b AS (SELECT * FROM unnest($1::text[], $2::bigint[], $3::bigint[])
                        AS b(id, heard, lease)),
                  locked AS (SELECT node_id FROM leases WHERE node_id = ANY($1)
                             FOR UPDATE SKIP LOCKED),
                  written AS (
                      UPDATE leases SET last_heartbeat_ms = GREATEST(leases.last_heartbeat_ms, b.heard),
                                        lease_until_ms = GREATEST(leases.lease_until_ms, b.lease)
                      FROM b, locked WHERE leases.node_id = b.id AND locked.node_id = b.id
                      RETURNING leases.node_id)
             SELECT node_id FROM leases WHERE node_id = ANY($1)
                 AND node_id NOT IN (SELECT node_id FROM written)",
            &[&ids, &heard, &leases],
        )?;
        let busy: std::collections::HashSet<&str> =
            busy.iter().map(|row| row.get::<_, &str>(0)).collect();
        Ok((beats.iter())
            .filter(|b| busy.contains(b.node_id.as_str()))
            .cloned()
            .collect())
    }

    fn set_program_refs(&mut self, digest: &Digest, refs: u64) -> StoreResult<()> {
        let refs = i64::try_from(refs)
            .map_err(|_| StoreError::Refused(format!("{refs} references to {digest}")))?;
        self.execute(
            "INSERT INTO program_refs (digest, refs) VALUES ($1, $2)
             ON CONFLICT (digest) DO UPDATE SET refs = EXCLUDED.refs",
            &[&digest.to_string(), &refs],
        )
    }

    fn remove_program(&mut self, digest: &Digest) -> StoreResult<()> {
        self.execute(
            "DELETE FROM program_refs WHERE digest = $1",
            &[&digest.to_string()],
        )
    }

    fn put_run(&mut self, run: &RunRow) -> StoreResult<()> {
        let id = run.id.as_str().to_string();
        self.runs.borrow_mut().insert(id.clone(), Some(run.clone()));
        self.unsent.borrow_mut().insert(id);
        Ok(())
    }

    fn read_runs_ahead(&mut self, ids: &[RunId]) -> StoreResult<()> {
        self.read_runs(ids)
    }

    fn read_nodes_ahead(&mut self, ids: &[NodeId]) -> StoreResult<()> {
        self.read_nodes(ids)
    }

    fn put_new_runs(&mut self, runs: &[RunRow]) -> StoreResult<()> {
        self.bulk.set(self.bulk.get() || runs.len() >= BULK_RUNS);
        (runs.chunks(RUNS_PER_STATEMENT)).try_for_each(|chunk| self.put_new_runs_at_once(chunk))
    }

    fn remove_run(&mut self, id: &RunId) -> StoreResult<()> {
        self.unsent.borrow_mut().remove(id.as_str());
        self.runs.borrow_mut().insert(id.as_str().to_string(), None);
        self.execute("DELETE FROM runs WHERE id = $1", &[&id.as_str()])
    }

    fn put_set(&mut self, id: &SetId, run_ids: &[RunId]) -> StoreResult<()> {
        let run_ids: Vec<&str> = run_ids.iter().map(RunId::as_str).collect();
        self.execute(
            "INSERT INTO sets (id, run_ids) VALUES ($1, $2)
             ON CONFLICT (id) DO UPDATE SET run_ids = EXCLUDED.run_ids",
            &[&id.as_str(), &run_ids],
        )
    }

    fn remove_set(&mut self, id: &SetId) -> StoreResult<()> {
        self.execute("DELETE FROM sets WHERE id = $1", &[&id.as_str()])
    }

    fn put_active(&mut self, run_id: &RunId, node_id: &NodeId) -> StoreResult<()> {
        self.execute(
            "INSERT INTO active_runs (run_id, node_id) VALUES ($1, $2)
             ON CONFLICT (run_id) DO UPDATE SET node_id = EXCLUDED.node_id",
            &[&run_id.as_str(), &node_id.as_str()],
        )
    }

    fn remove_active(&mut self, run_id: &RunId, _node_id: &NodeId) -> StoreResult<()> {
        self.execute(
            "DELETE FROM active_runs WHERE run_id = $1",
            &[&run_id.as_str()],
        )
    }

    fn put_waiting(&mut self, run_id: &RunId, node_id: &NodeId) -> StoreResult<()> {
        self.announce.set(true);
        self.execute(
            "INSERT INTO waiting_runs (node_id, run_id) VALUES ($1, $2) ON CONFLICT DO NOTHING",
            &[&node_id.as_str(), &run_id.as_str()],
        )
    }

    fn remove_waiting(&mut self, run_id: &RunId, node_id: &NodeId) -> StoreResult<()> {
        self.execute(
            "DELETE FROM waiting_runs WHERE node_id = $1 AND run_id = $2",
            &[&node_id.as_str(), &run_id.as_str()],
        )
    }

    fn push_final(&mut self, run_id: &RunId, node_id: &NodeId) -> StoreResult<()> {
        self.execute(
            "INSERT INTO final_runs (run_id, node_id) VALUES ($1, $2)",
            &[&run_id.as_str(), &node_id.as_str()],
        )
    }

    fn put_coordinator(&mut self, address: &str, seen_ms: u64) -> StoreResult<()> {
        self.execute(
            "INSERT INTO coordinators (address, seen_ms) VALUES ($1, $2)
             ON CONFLICT (address) DO UPDATE SET seen_ms = EXCLUDED.seen_ms",
            &[&address, &bigint(seen_ms)?],
        )
    }

    fn add_program_refs(&mut self, digest: &Digest, count: u64) -> StoreResult<()> {
        let count = i64::try_from(count)
            .map_err(|_| StoreError::Refused(format!("{count} references to {digest}")))?;
        self.execute(
            "INSERT INTO program_refs (digest, refs) VALUES ($1, $2)
             ON CONFLICT (digest) DO UPDATE SET refs = program_refs.refs + EXCLUDED.refs",
            &[&digest.to_string(), &count],
        )
    }

    /// An update that changes nothing still makes a new row version: it waits for a closing
    /// transaction under way, and fails a serializable one that began before this commits.
    fn hold_node_changes(&mut self) -> StoreResult<()> {
        self.execute(
            "INSERT INTO meta (key, value) VALUES ('node_ends', 0)
             ON CONFLICT (key) DO UPDATE SET value = meta.value",
            &[],
        )
    }

    fn count_node_change(&mut self) -> StoreResult<()> {
        self.execute(
            "INSERT INTO meta (key, value) VALUES ('node_ends', 1)
             ON CONFLICT (key) DO UPDATE SET value = meta.value + 1",
            &[],
        )
    }

    fn set_fleet_entry(&mut self, entry: FleetEntry, value: &str) -> StoreResult<()> {
        self.execute(
            "INSERT INTO fleet (key, value) VALUES ($1, $2)
             ON CONFLICT (key) DO UPDATE SET value = $2",
            &[&entry.key(), &value],
        )
    }

    fn remove_node(&mut self, id: &NodeId) -> StoreResult<()> {
        {
            let mut unsent = self.unsent_nodes.borrow_mut();
            unsent.records.remove(id.as_str());
            unsent.leases.remove(id.as_str());
            unsent.marks.remove(id.as_str());
        }
        self.nodes
            .borrow_mut()
            .insert(id.as_str().to_string(), None);
        self.execute("DELETE FROM nodes WHERE id = $1", &[&id.as_str()])?;
        self.execute("DELETE FROM leases WHERE node_id = $1", &[&id.as_str()])?;
        self.execute(
            "DELETE FROM event_marks WHERE node_id = $1",
            &[&id.as_str()],
        )
    }

    fn pop_final(&mut self, node_id: &NodeId) -> StoreResult<Option<RunId>> {
        let row = self.query_opt(
            "DELETE FROM final_runs
             WHERE seq = (SELECT min(seq) FROM final_runs WHERE node_id = $1)
             RETURNING run_id",
            &[&node_id.as_str()],
        )?;
        row.map(|row| stored_run_id(row.get(0))).transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::redact;

    #[test]
    fn a_table_is_locked_after_the_relation_setting_or_a_share_of_the_transaction_one() {
        use super::{ROWS_A_BATCH_READS, SUGGESTED_PRED_LOCKS, rows_before_table_lock};
        // PostgreSQL's defaults: 64 and -2, a table lock after 32 rows.
        assert_eq!(rows_before_table_lock(64, -2), 32);
        assert_eq!(rows_before_table_lock(64, 5000), 5000);
        assert_eq!(rows_before_table_lock(4096, -4), 1024);
        assert!(rows_before_table_lock(SUGGESTED_PRED_LOCKS, -2) >= ROWS_A_BATCH_READS);
    }

    #[test]
    fn passwords_are_hidden_in_locations() {
        assert_eq!(
            redact("postgres://fleet:s3cr:et@db.example:5432/fleet?sslmode=require"),
            "postgres://fleet:***@db.example:5432/fleet?sslmode=require"
        );
        assert_eq!(
            redact("postgresql://fleet@%2Frun%2Fpg/fleet?password=s3cret&application_name=x"),
            "postgresql://fleet@%2Frun%2Fpg/fleet?password=***&application_name=x"
        );
        assert_eq!(
            redact("postgres://fleet@db/fleet"),
            "postgres://fleet@db/fleet"
        );
        assert_eq!(redact("postgres://db"), "postgres://db");
    }

    #[test]
    fn sslrootcert_is_taken_out_of_the_url() {
        use super::take_param;
        let url = "postgres://u@db/fleet?sslmode=require&sslrootcert=/etc/ca.pem&connect_timeout=5";
        assert_eq!(
            take_param(url, "sslrootcert"),
            (
                "postgres://u@db/fleet?sslmode=require&connect_timeout=5".to_string(),
                Some("/etc/ca.pem".to_string())
            )
        );
        assert_eq!(
            take_param("postgres://u@db/fleet?sslrootcert=ca.pem", "sslrootcert"),
            (
                "postgres://u@db/fleet".to_string(),
                Some("ca.pem".to_string())
            )
        );
        assert_eq!(
            take_param("postgres://u@db/fleet", "sslrootcert"),
            ("postgres://u@db/fleet".to_string(), None)
        );
    }
}
