//! Where a machine's binaries live: one folder per release (`releases/SEQUENCE/`), one link
//! `current` to the release that runs, and `fleet-agent` and `fleet-run-supervisor` at the root as
//! links through `current`, so the unit's `ExecStart` never changes and one rename swaps both. The
//! bootstrap's plain files become release 0 at the first update. At every moment the root's
//! `fleet-agent` is a whole binary: the old one or the new one, never none.
use std::io;
use std::path::{Path, PathBuf};

/// The binaries a release installs, each at the root through `current`.
pub const BINARIES: [&str; 2] = ["fleet-agent", "fleet-run-supervisor"];
/// The release the bootstrap unpacked.
pub const BOOTSTRAP: u64 = 0;

#[derive(Debug, Clone)]
pub struct Install {
    root: PathBuf,
}

impl Install {
    pub fn new(root: impl Into<PathBuf>) -> Install {
        Install { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The agent the unit starts: the root's link (or the bootstrap's plain file).
    pub fn agent(&self) -> PathBuf {
        self.root.join(BINARIES[0])
    }

    pub fn release_dir(&self, sequence: u64) -> PathBuf {
        self.root.join("releases").join(sequence.to_string())
    }

    fn current(&self) -> PathBuf {
        self.root.join("current")
    }

    /// The sequence of the release that runs: where `current` points, or the bootstrap's.
    pub fn running(&self) -> u64 {
        std::fs::read_link(self.current())
            .ok()
            .and_then(|target| target.file_name()?.to_str()?.parse().ok())
            .unwrap_or(BOOTSTRAP)
    }

    /// Turns the bootstrap's plain files into release 0 behind `current` (once): each file is
    /// hard-linked into the release's folder first, then replaced by its link by a rename.
    pub fn adopt(&self) -> io::Result<()> {
        if std::fs::symlink_metadata(self.current()).is_ok() {
            return Ok(());
        }
        let dir = self.release_dir(BOOTSTRAP);
        std::fs::create_dir_all(&dir)?;
        for name in BINARIES {
            let (plain, kept) = (self.root.join(name), dir.join(name));
            if !kept.exists() {
                std::fs::hard_link(&plain, &kept).map_err(|e| {
                    io::Error::new(e.kind(), format!("cannot keep {}: {e}", plain.display()))
                })?;
            }
        }
        sync_dir(&dir)?;
        self.point(
            &self.current(),
            &Path::new("releases").join(BOOTSTRAP.to_string()),
        )?;
        for name in BINARIES {
            self.point(&self.root.join(name), &Path::new("current").join(name))?;
        }
        Ok(())
    }

    /// Installs `files` (name, path of its checked bytes) as release `sequence`: written into a
    /// folder of its own, synced, then renamed into place; a folder a cut try left is replaced.
    pub fn install(&self, sequence: u64, files: &[(&str, PathBuf)]) -> io::Result<()> {
        let releases = self.root.join("releases");
        let staging = releases.join(format!(".staging-{sequence}"));
        let _ = std::fs::remove_dir_all(&staging);
        std::fs::create_dir_all(&staging)?;
        for (name, from) in files {
            let to = staging.join(name);
            std::fs::copy(from, &to)?;
            let file = std::fs::File::open(&to)?;
            file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
            file.sync_all()?;
        }
        sync_dir(&staging)?;
        let target = self.release_dir(sequence);
        let _ = std::fs::remove_dir_all(&target);
        std::fs::rename(&staging, &target)?;
        sync_dir(&releases)
    }

    /// Points `current` at release `sequence`, atomically.
    pub fn switch(&self, sequence: u64) -> io::Result<()> {
        let target = Path::new("releases").join(sequence.to_string());
        self.point(&self.current(), &target)
    }

    /// Removes every release folder but `keep`'s.
    pub fn prune(&self, keep: &[u64]) {
        let Ok(entries) = std::fs::read_dir(self.root.join("releases")) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let sequence = name.to_str().and_then(|n| n.parse::<u64>().ok());
            if sequence.is_some_and(|s| !keep.contains(&s)) {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }

    /// Makes `link` point at `target` by renaming a fresh link over it.
    fn point(&self, link: &Path, target: &Path) -> io::Result<()> {
        let name = link.file_name().and_then(|n| n.to_str()).unwrap_or("link");
        let fresh = self.root.join(format!(".{name}.new"));
        let _ = std::fs::remove_file(&fresh);
        std::os::unix::fs::symlink(target, &fresh)?;
        std::fs::rename(&fresh, link)?;
        sync_dir(&self.root)
    }
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(path: &Path) -> String {
        std::fs::read_to_string(path).unwrap()
    }

    #[test]
    fn the_bootstrap_becomes_release_0_and_a_switch_moves_both_binaries() {
        let dir = tempfile::tempdir().unwrap();
        let install = Install::new(dir.path());
        for name in BINARIES {
            std::fs::write(dir.path().join(name), format!("{name} 0")).unwrap();
        }
        assert_eq!(install.running(), BOOTSTRAP);
        install.adopt().unwrap();
        install.adopt().unwrap();
        assert_eq!(install.running(), BOOTSTRAP);
        assert_eq!(read(&install.agent()), "fleet-agent 0");
        let staged = dir.path().join("staged");
        std::fs::create_dir(&staged).unwrap();
        let files: Vec<(&str, PathBuf)> = (BINARIES.iter())
            .map(|name| {
                let path = staged.join(name);
                std::fs::write(&path, format!("{name} 7")).unwrap();
                (*name, path)
            })
            .collect();
        install.install(7, &files).unwrap();
        assert_eq!(
            read(&install.agent()),
            "fleet-agent 0",
            "installing switches nothing"
        );
        install.switch(7).unwrap();
        assert_eq!(install.running(), 7);
        assert_eq!(read(&install.agent()), "fleet-agent 7");
        assert_eq!(
            read(&dir.path().join("fleet-run-supervisor")),
            "fleet-run-supervisor 7"
        );
        install.switch(BOOTSTRAP).unwrap();
        assert_eq!(read(&install.agent()), "fleet-agent 0");
        install.prune(&[BOOTSTRAP]);
        assert!(!install.release_dir(7).exists());
        assert!(install.release_dir(BOOTSTRAP).exists());
    }
}
