//! A throwaway PostgreSQL cluster from Debian's packages for the store tests: made by `initdb`
//! as the `postgres` user (the tests run as root, which PostgreSQL refuses to run as), listening
//! only on a unix socket in its own temporary folder, stopped and removed when dropped, also when
//! a test fails.
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};

/// One cluster; `postgres` is its superuser, trusted on its socket.
pub struct Postgres {
    dir: tempfile::TempDir,
    bin: PathBuf,
    next_db: AtomicU64,
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

fn is_root() -> bool {
    crate::ok(Command::new("id").arg("-u")).trim() == "0"
}

impl Postgres {
    /// Makes and starts a cluster (about a second).
    pub fn start() -> Postgres {
        let bin = bin_dir();
        let dir = crate::tempdir();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        if is_root() {
            crate::ok(
                Command::new("chown")
                    .arg("postgres:postgres")
                    .arg(dir.path()),
            );
        }
        let pg = Postgres {
            dir,
            bin,
            next_db: AtomicU64::new(0),
        };
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
        cmd.arg("-D").arg(self.data()).args(["-w", "-m", "fast"]);
        if action != "stop" {
            cmd.arg("-l")
                .arg(self.dir.path().join("server.log"))
                .arg("-o")
                .arg(format!("-k {} -h '' -F", self.dir.path().display()));
        }
        crate::ok(cmd.arg(action));
    }

    /// Stops the server (fast: sessions are cut) and starts it again on the same socket.
    pub fn restart(&self) {
        self.pg_ctl("restart");
    }

    /// The folder holding the server's socket.
    pub fn socket_dir(&self) -> &Path {
        self.dir.path()
    }

    /// The URL of database `db` on this cluster, as the superuser.
    pub fn url(&self, db: &str) -> String {
        let host = self.socket_dir().display().to_string().replace('/', "%2F");
        format!("postgres://postgres@{host}/{db}")
    }

    /// Creates a new, empty database; returns its URL.
    pub fn fresh_database(&self) -> String {
        let db = format!("fleet_{}", self.next_db.fetch_add(1, Ordering::Relaxed));
        self.sql("postgres", &format!("CREATE DATABASE {db}"));
        self.url(&db)
    }

    /// Runs SQL in database `db` with `psql`; returns its unaligned output.
    pub fn sql(&self, db: &str, sql: &str) -> String {
        let mut cmd = Command::new(self.bin.join("psql"));
        cmd.arg("-h").arg(self.socket_dir()).args([
            "-U",
            "postgres",
            "-d",
            db,
            "-v",
            "ON_ERROR_STOP=1",
            "-Atc",
            sql,
        ]);
        crate::ok(&mut cmd)
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
