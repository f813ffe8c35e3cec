//! A throwaway PostgreSQL cluster from Debian's packages for `bench fleet --store postgres`: made
//! by `initdb` as the `postgres` user (xtask runs as root, which PostgreSQL refuses), on a unix
//! socket in its own folder, with the server's defaults (fsync on) but the predicate locks `serve`
//! advises, stopped when dropped.
use crate::util;
use anyhow::{Context, Result};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

pub struct Cluster {
    dir: PathBuf,
    bin: PathBuf,
}

/// The newest installed PostgreSQL's programs.
fn bin_dir() -> Result<PathBuf> {
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .context(
            "PostgreSQL is not installed: apt-get install -y postgresql, or run `cargo xtask ci`",
        )?
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.parse().ok()?;
            let bin = entry.path().join("bin");
            bin.join("initdb").exists().then_some((version, bin))
        })
        .collect();
    found.sort();
    found
        .pop()
        .map(|(_, bin)| bin)
        .context("no /usr/lib/postgresql/*/bin/initdb")
}

impl Cluster {
    /// Makes and starts a cluster in `dir` (emptied first), with room for `connections`.
    pub fn start(dir: &Path, connections: usize) -> Result<Cluster> {
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
        util::run(Command::new("chown").args(["postgres:postgres"]).arg(dir))?;
        let cluster = Cluster {
            dir: dir.to_path_buf(),
            bin: bin_dir()?,
        };
        util::run(
            cluster
                .as_owner("initdb")
                .args([
                    "--auth=trust",
                    "--username=postgres",
                    "--no-instructions",
                    "-D",
                ])
                .arg(cluster.data()),
        )?;
        let conf = cluster.data().join("postgresql.conf");
        let mut text = std::fs::read_to_string(&conf)?;
        text.push_str(&format!(
            "\nunix_socket_directories = '{}'\nlisten_addresses = ''\nmax_connections = {connections}\n\
             max_pred_locks_per_transaction = 4096\n",
            dir.display()
        ));
        std::fs::write(&conf, text)?;
        cluster.pg_ctl("start")?;
        util::run(
            cluster
                .psql("postgres")
                .args(["-c", "CREATE DATABASE fleet"]),
        )?;
        Ok(cluster)
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn as_owner(&self, program: &str) -> Command {
        let mut cmd = Command::new("runuser");
        cmd.args(["-u", "postgres", "--"])
            .arg(self.bin.join(program));
        cmd.current_dir(&self.dir);
        cmd
    }

    fn pg_ctl(&self, action: &str) -> Result<()> {
        let mut cmd = self.as_owner("pg_ctl");
        cmd.arg("-D")
            .arg(self.data())
            .args(["-w", "-m", "fast", "-l"])
            .arg(self.dir.join("server.log"))
            .arg(action);
        util::run(&mut cmd)
    }

    fn psql(&self, db: &str) -> Command {
        let mut cmd = Command::new(self.bin.join("psql"));
        cmd.arg("-h")
            .arg(&self.dir)
            .args(["-U", "postgres", "-d", db, "-At"]);
        cmd
    }

    /// The bench's database, on the socket.
    pub fn url(&self) -> String {
        let host = self.dir.display().to_string().replace('/', "%2F");
        format!("postgres://postgres@{host}/fleet")
    }

    /// Transactions committed in the bench's database so far.
    pub fn commits(&self) -> Result<u64> {
        let out = self
            .psql("postgres")
            .args([
                "-c",
                "SELECT xact_commit FROM pg_stat_database WHERE datname = 'fleet'",
            ])
            .output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        text.trim().parse().with_context(|| {
            format!(
                "psql read no commit count ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )
        })
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = self.pg_ctl("stop");
    }
}
