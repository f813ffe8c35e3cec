//! A throwaway PostgreSQL cluster from Debian's packages for the store tests: made by `initdb`
//! as the `postgres` user (the tests run as root, which PostgreSQL refuses to run as), listening
//! on a unix socket in its own temporary folder (and, when asked, on a loopback port with TLS),
//! stopped and removed when dropped, also when a test fails.
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};

/// One cluster; `postgres` is its superuser, trusted on its socket and its loopback port.
pub struct Postgres {
    dir: tempfile::TempDir,
    bin: PathBuf,
    next_db: AtomicU64,
    /// The port: in the socket's name, and on 127.0.0.1 when TLS was asked for.
    port: u16,
    tcp: bool,
}

/// The newest installed PostgreSQL's programs.
fn bin_dir() -> PathBuf {
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.parse().ok()?;
            let bin = entry.path().join("bin");
            bin.join("initdb").exists().then_some((version, bin))
        })
        .collect();
    found.sort();
    found.pop().map(|(_, bin)| bin).unwrap_or_else(|| {
        panic!(
            "PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb): apt-get install -y postgresql, or run `cargo xtask ci`, which installs it"
        )
    })
}

fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a free loopback port");
    listener.local_addr().unwrap().port()
}

fn is_root() -> bool {
    crate::ok(Command::new("id").arg("-u")).trim() == "0"
}

impl Postgres {
    /// Makes and starts a cluster on a unix socket only (about two seconds).
    pub fn start() -> Postgres {
        Postgres::launch(None)
    }

    /// Makes and starts a cluster that also listens on 127.0.0.1 (a free port) with TLS, from
    /// the PEM certificate and key given.
    pub fn start_with_tls(cert: &Path, key: &Path) -> Postgres {
        Postgres::launch(Some((cert, key)))
    }

    fn launch(tls: Option<(&Path, &Path)>) -> Postgres {
        let dir = crate::tempdir();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        let pg = Postgres {
            dir,
            bin: bin_dir(),
            next_db: AtomicU64::new(0),
            port: if tls.is_some() { free_port() } else { 5432 },
            tcp: tls.is_some(),
        };
        let mut settings = format!(
            "\nunix_socket_directories = '{}'\nport = {}\nlisten_addresses = '{}'\nfsync = off\n",
            pg.socket_dir().display(),
            pg.port,
            if pg.tcp { "127.0.0.1" } else { "" },
        );
        if let Some((cert, key)) = tls {
            let copy = |from: &Path, name: &str| {
                let to = pg.dir.path().join(name);
                std::fs::copy(from, &to).unwrap();
                std::fs::set_permissions(&to, std::fs::Permissions::from_mode(0o600)).unwrap();
                to.display().to_string()
            };
            settings.push_str(&format!(
                "ssl = on\nssl_cert_file = '{}'\nssl_key_file = '{}'\n",
                copy(cert, "server.crt"),
                copy(key, "server.key")
            ));
        }
        if is_root() {
            crate::ok(
                Command::new("chown")
                    .args(["-R", "postgres:postgres"])
                    .arg(pg.dir.path()),
            );
        }
        crate::ok(
            pg.as_owner("initdb")
                .args([
                    "--auth=trust",
                    "--username=postgres",
                    "--no-sync",
                    "--no-instructions",
                    "--encoding=UTF8",
                    "-D",
                ])
                .arg(pg.data()),
        );
        let conf = pg.data().join("postgresql.conf");
        let mut text = std::fs::read_to_string(&conf).unwrap();
        text.push_str(&settings);
        std::fs::write(&conf, text).unwrap();
        pg.pg_ctl("start");
        pg
    }

    /// A command for one of PostgreSQL's server programs, run as the cluster's owner.
    fn as_owner(&self, program: &str) -> Command {
        let program = self.bin.join(program);
        let mut cmd = if is_root() {
            let mut cmd = Command::new("runuser");
            cmd.args(["-u", "postgres", "--"]).arg(program);
            cmd
        } else {
            Command::new(program)
        };
        cmd.current_dir(self.dir.path());
        cmd
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn pg_ctl(&self, action: &str) {
        let mut cmd = self.as_owner("pg_ctl");
        cmd.arg("-D")
            .arg(self.data())
            .args(["-w", "-m", "fast", "-l"])
            .arg(self.dir.path().join("server.log"));
        crate::ok(cmd.arg(action));
    }

    /// Stops the server (fast: sessions are cut) and starts it again on the same socket.
    pub fn restart(&self) {
        self.pg_ctl("restart");
    }

    /// Stops the server (fast: sessions are cut); [`Postgres::start_again`] brings it back.
    pub fn stop(&self) {
        self.pg_ctl("stop");
    }

    /// Starts a stopped server again on the same socket.
    pub fn start_again(&self) {
        self.pg_ctl("start");
    }

    /// The folder holding the server's socket.
    pub fn socket_dir(&self) -> &Path {
        self.dir.path()
    }

    /// The URL of database `db` on this cluster's socket, as the superuser.
    pub fn url(&self, db: &str) -> String {
        let host = self.socket_dir().display().to_string().replace('/', "%2F");
        format!("postgres://postgres@{host}:{}/{db}", self.port)
    }

    /// The URL of database `db` on this cluster's loopback port (a cluster started with TLS).
    pub fn tcp_url(&self, db: &str) -> String {
        assert!(self.tcp, "this cluster listens on its unix socket only");
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    /// Creates a new, empty database; returns its URL.
    pub fn fresh_database(&self) -> String {
        let db = format!("fleet_{}", self.next_db.fetch_add(1, Ordering::Relaxed));
        self.sql("postgres", &format!("CREATE DATABASE {db}"));
        self.url(&db)
    }

    /// Runs SQL in database `db` with `psql`; returns its unaligned output.
    pub fn sql(&self, db: &str, sql: &str) -> String {
        crate::ok(&mut self.psql(db, sql))
    }

    /// Starts `psql` running SQL in database `db`, its output dropped; the caller waits for it.
    pub fn sql_started(&self, db: &str, sql: &str) -> std::process::Child {
        (self.psql(db, sql).stdout(std::process::Stdio::null()))
            .spawn()
            .expect("can start psql")
    }

    fn psql(&self, db: &str, sql: &str) -> Command {
        let mut cmd = Command::new(self.bin.join("psql"));
        cmd.arg("-h")
            .arg(self.socket_dir())
            .args(["-p", &self.port.to_string(), "-U", "postgres", "-d", db])
            .args(["-v", "ON_ERROR_STOP=1", "-Atc", sql]);
        cmd
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let mut cmd = self.as_owner("pg_ctl");
        cmd.arg("-D")
            .arg(self.data())
            .args(["-w", "-m", "immediate", "stop"]);
        let _ = crate::output(&mut cmd);
    }
}
