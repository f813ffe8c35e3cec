//! Self-update from signed releases. The node checks a release itself (its chain under the
//! fleet's roots from the join file, expiry, sequence above what it runs and its floor, target,
//! each binary's digest), fetches the binaries by digest on the content path, installs them in a
//! folder of their own, and then, in this order: records the trial, starts a watchdog from the
//! old binary, switches the `current` link, answers, and execs the new agent.
//!
//! The new agent is on trial for [`Releases::trial`]: it keeps the release once it held a session,
//! its self-check passed (the new supervisor runs) and it stayed up three quarters of its trial
//! (so a release that crashes 10 s in is reverted, not kept); otherwise it reverts itself (for
//! want of a session, blamed on the release only once the restored agent holds one).
//! The watchdog reverts when the new agent exits during its trial or never finishes it, and the
//! unit's restart starts the old agent through the link. A reverted release is never tried again.
mod install;
mod record;
mod watch;

pub use install::{BINARIES, BOOTSTRAP, Install};
pub use record::{ReleaseRecord, TrialTerms};
pub use watch::{WatchArgs, watch};

use fleet_proto::Digest;
use fleet_proto::clock::now_ms;
use fleet_proto::pin::PinnedKey;
use fleet_proto::protocol::{Answer, Refusal, RefusalClass, Reply};
use fleet_proto::release::{
    ReleaseFacts, ReleaseManifest, ReleaseOffer, ReleaseTrust, UpdateOutcome,
};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::time::Duration;

/// The target this agent takes releases for.
#[cfg(target_arch = "x86_64")]
pub const TARGET: &str = "x86_64-unknown-linux-musl";
#[cfg(target_arch = "aarch64")]
pub const TARGET: &str = "aarch64-unknown-linux-musl";

/// The default trial: past it without keeping, the release is reverted.
pub const DEFAULT_TRIAL: Duration = Duration::from_secs(20);
/// How long past the trial the watchdog waits for a new agent that neither kept nor reverted.
const WATCH_GRACE: Duration = Duration::from_secs(3);

/// The releases of this machine: where its binaries live, its state, and the roots it trusts.
#[derive(Debug, Clone)]
pub struct Releases {
    pub install: Install,
    pub state: PathBuf,
    /// The join file's roots: trusted until a signed release rotates them (see [`ReleaseRecord::trust`]).
    pub roots: Vec<PinnedKey>,
    pub trial: Duration,
    /// The release this process was started as: an answer recorded for an update it already
    /// runs (the coordinator asking again after a lost answer) restarts nothing.
    pub started_as: u64,
}

/// What an agent does at its start about an update a restart cut into.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AtStart {
    /// Nothing under way.
    Normal,
    /// This agent is the new one, on trial until `deadline_ms` (Unix ms).
    OnTrial {
        from: u64,
        to: u64,
        deadline_ms: u64,
    },
}

/// What taking a checked release installs.
enum ToInstall {
    /// This machine runs it already.
    Nothing { from: u64 },
    /// Its binaries for this target, above `floor`.
    Binaries {
        manifest: ReleaseManifest,
        floor: u64,
    },
}

fn refused(message: impl std::fmt::Display) -> Refusal {
    Refusal::new(RefusalClass::Release, message)
}

impl Releases {
    /// What the facts say: the release that runs and the last update.
    pub fn facts(&self) -> ReleaseFacts {
        ReleaseFacts {
            sequence: self.install.running(),
            update: ReleaseRecord::load(&self.state).ok().and_then(|r| r.last),
        }
    }

    /// What this machine trusts now: what the last release that changed it said, or the join
    /// file's roots.
    pub fn trust(&self, record: &ReleaseRecord) -> ReleaseTrust {
        (record.trust.clone()).unwrap_or_else(|| ReleaseTrust::of_roots(self.roots.clone()))
    }

    /// Takes a release (blocking): checks it, fetches and installs its binaries, records the
    /// trial, starts the watchdog and switches; the caller answers, then calls [`Releases::exec`].
    /// A refusal is recorded too, so the coordinator reads it in the facts.
    pub fn take(
        &self,
        offer: &ReleaseOffer,
        fetch: &dyn Fn(&Digest) -> Result<PathBuf, Refusal>,
    ) -> Answer {
        let mut record = ReleaseRecord::load(&self.state).map_err(refused)?;
        let answer = self.install_and_switch(&mut record, offer, fetch);
        if let Err(refusal) = &answer {
            let sequence = (offer.verify(&self.trust(&record), now_ms())).map_or(0, |m| m.sequence);
            tracing::warn!("refused a release: {}", refusal.message);
            record.last = Some(UpdateOutcome::Refused {
                sequence,
                reason: refusal.message.clone(),
            });
            if let Err(e) = record.save(&self.state) {
                tracing::warn!("cannot record the refused release: {e}");
            }
        }
        answer
    }

    /// The binaries taking `offer` would fetch, fetched ahead of [`Releases::take`] so that it
    /// never waits on the network; none where it refuses the offer or runs it already.
    pub fn wanted(&self, offer: &ReleaseOffer) -> Vec<Digest> {
        let Ok(record) = ReleaseRecord::load(&self.state) else {
            return Vec::new();
        };
        match self.to_install(&record, offer) {
            Ok(ToInstall::Binaries { manifest, floor }) => BINARIES
                .iter()
                .filter_map(|name| manifest.binary_for(name, TARGET, floor).ok())
                .map(|binary| binary.sha256)
                .collect(),
            _ => Vec::new(),
        }
    }

    /// What taking `offer` installs, once checked against what this machine trusts and tried.
    fn to_install(
        &self,
        record: &ReleaseRecord,
        offer: &ReleaseOffer,
    ) -> Result<ToInstall, Refusal> {
        let trust = self.trust(record);
        if trust.roots.is_empty() {
            return Err(refused(
                "this machine trusts no release root (its join file named none): join it with a token minted after `fleet-coordinator release trust`",
            ));
        }
        let manifest = offer.verify(&trust, now_ms()).map_err(refused)?;
        let to = manifest.sequence;
        if let Some(reason) = record.never.get(&to) {
            return Err(refused(format!(
                "release {to} was reverted on this machine ({reason}); it is never tried again"
            )));
        }
        let from = self.install.running();
        if to == from {
            return Ok(ToInstall::Nothing { from });
        }
        let floor = from.max(record.floor);
        Ok(ToInstall::Binaries { manifest, floor })
    }

    fn install_and_switch(
        &self,
        record: &mut ReleaseRecord,
        offer: &ReleaseOffer,
        fetch: &dyn Fn(&Digest) -> Result<PathBuf, Refusal>,
    ) -> Answer {
        let (manifest, floor) = match self.to_install(record, offer)? {
            // It runs it already: nothing to install, nothing to restart.
            ToInstall::Nothing { from } => return Ok(Reply::Updating { from, to: from }),
            ToInstall::Binaries { manifest, floor } => (manifest, floor),
        };
        let (trust, from, to) = (
            self.trust(record),
            self.install.running(),
            manifest.sequence,
        );
        tracing::info!(version = %manifest.version, "taking release {to}: fetching and installing it");
        let mut files = Vec::new();
        for name in BINARIES {
            let binary = manifest.binary_for(name, TARGET, floor).map_err(refused)?;
            let path = fetch(&binary.sha256)?;
            let size = std::fs::metadata(&path).map_err(refused)?.len();
            binary.check(&binary.sha256, size).map_err(refused)?;
            files.push((name, path));
        }
        let failed = |what: &str, e: std::io::Error| refused(format!("{what} failed: {e}"));
        self.install
            .adopt()
            .map_err(|e| failed("keeping the running release", e))?;
        (self.install.install(to, &files)).map_err(|e| failed("installing the release", e))?;
        record.trial = Some(TrialTerms {
            began_at_ms: now_ms(),
            min_sequence: manifest.min_sequence,
        });
        record.last = Some(UpdateOutcome::Trial { from, to });
        // A rotation or revocation holds from here on, whatever becomes of the release itself.
        let after = trust.after(&manifest);
        if after != trust {
            tracing::info!(roots = ?after.roots, revoked = ?after.revoked, "release {to} changed the keys this machine trusts");
            record.trust = Some(after);
        }
        record
            .save(&self.state)
            .map_err(|e| failed("recording the trial", e))?;
        if let Err(e) = self.start_watchdog(from, to) {
            record.trial = None;
            record.last = None;
            let _ = record.save(&self.state);
            return Err(failed("starting the update's watchdog", e));
        }
        self.install
            .switch(to)
            .map_err(|e| failed("switching to the release", e))?;
        tracing::info!(from, to, version = %manifest.version, "installed a release; restarting into it on trial");
        Ok(Reply::Updating { from, to })
    }

    /// The watchdog, from the old release's binary, detached through `sh` so no one has to reap it.
    fn start_watchdog(&self, from: u64, to: u64) -> std::io::Result<()> {
        let old = match from {
            BOOTSTRAP if !self.install.release_dir(from).join(BINARIES[0]).exists() => {
                self.install.agent()
            }
            _ => self.install.release_dir(from).join(BINARIES[0]),
        };
        let deadline = now_ms() + (self.trial + WATCH_GRACE).as_millis() as u64;
        let status = std::process::Command::new("sh")
            .arg("-c")
            .arg("\"$0\" \"$@\" </dev/null >/dev/null &")
            .arg(old)
            .arg("watch-update")
            .arg("--state")
            .arg(&self.state)
            .arg("--install-dir")
            .arg(self.install.root())
            .args(["--pid", &std::process::id().to_string()])
            .args(["--from", &from.to_string(), "--to", &to.to_string()])
            .args(["--deadline-ms", &deadline.to_string()])
            .status()?;
        match status.success() {
            true => Ok(()),
            false => Err(std::io::Error::other(format!("sh exited {status}"))),
        }
    }

    /// Becomes the agent the unit's link names now, with the same arguments; returns only when
    /// the exec failed.
    pub fn exec(&self) -> std::io::Error {
        std::process::Command::new(self.install.agent())
            .args(std::env::args_os().skip(1))
            .exec()
    }

    /// At the agent's start: finishes what a cut update left, and says whether this agent is on
    /// trial. Returns only when this agent should run; otherwise it execs the restored one.
    pub fn at_start(&self) -> std::io::Result<AtStart> {
        let mut record = ReleaseRecord::load(&self.state)?;
        let running = self.install.running();
        match (&record.last, &record.trial) {
            (Some(UpdateOutcome::Trial { from, to }), Some(terms)) if running == *to => {
                let deadline_ms = terms.began_at_ms + self.trial.as_millis() as u64;
                Ok(AtStart::OnTrial {
                    from: *from,
                    to: *to,
                    deadline_ms,
                })
            }
            (Some(UpdateOutcome::Trial { from, to }), _) => {
                // Cut off before the switch: the old agent runs, nothing is blamed.
                let (from, to) = (*from, *to);
                record.trial = None;
                record.last = Some(UpdateOutcome::Reverted {
                    from,
                    to,
                    reason: "the swap was cut off before the switch".into(),
                });
                record.save(&self.state)?;
                Ok(AtStart::Normal)
            }
            (Some(UpdateOutcome::Reverted { from, to, .. }), _) if running == *to => {
                // Reverted, and restarted into the new agent before the switch back: finish it.
                tracing::warn!(from, to, "release {to} was reverted; restoring {from}");
                self.install.switch(*from)?;
                Err(self.exec())
            }
            _ => Ok(AtStart::Normal),
        }
    }

    /// The new agent's trial: keeps the release once `in_session` held, the new supervisor runs
    /// and three quarters of the trial passed since `started`; reverts itself at the deadline.
    /// Returns once kept.
    pub async fn trial(
        &self,
        from: u64,
        to: u64,
        deadline_ms: u64,
        started: tokio::time::Instant,
        in_session: &(dyn Fn() -> bool + Sync),
    ) {
        let (mut had_session, mut checked) = (false, false);
        loop {
            if now_ms() >= deadline_ms {
                let reason = match (had_session, checked) {
                    (false, _) => format!("no session within {} s", self.trial.as_secs()),
                    (true, false) => {
                        "its self-check failed: the new supervisor does not run".into()
                    }
                    (true, true) => "it did not stay up in session through its trial".into(),
                };
                if let Err(e) = self.revert_self(from, to, reason, !had_session) {
                    tracing::error!("cannot restore release {from}: {e}");
                    return;
                }
                // A fresh process through the link, as the unit starts it (an exec would keep
                // whatever this process's environment got wrong).
                tracing::error!("exiting so that the unit starts release {from}");
                std::process::exit(1);
            }
            if in_session() {
                had_session = true;
                if !checked {
                    checked = self.self_check(to).await;
                }
            }
            if checked && started.elapsed() >= self.trial * 3 / 4 && in_session() {
                match self.keep(from, to) {
                    Ok(()) => {
                        tracing::info!(from, to, "kept release {to} after its trial");
                        return;
                    }
                    Err(e) => tracing::warn!("cannot record the kept release: {e}"),
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The new release's supervisor runs.
    async fn self_check(&self, to: u64) -> bool {
        let supervisor = self.install.release_dir(to).join(BINARIES[1]);
        let run = tokio::process::Command::new(&supervisor)
            .arg("--help")
            .stdout(std::process::Stdio::null())
            .kill_on_drop(true)
            .status();
        match tokio::time::timeout(Duration::from_secs(10), run).await {
            Ok(Ok(status)) if status.success() => true,
            other => {
                tracing::warn!(supervisor = %supervisor.display(), "the self-check failed: {other:?}");
                false
            }
        }
    }

    fn keep(&self, from: u64, to: u64) -> std::io::Result<()> {
        let mut record = ReleaseRecord::load(&self.state)?;
        let floor = record.trial.as_ref().map_or(0, |t| t.min_sequence);
        record.floor = record.floor.max(floor);
        record.trial = None;
        record.unconfirmed = false;
        record.last = Some(UpdateOutcome::Kept { from, to });
        record.save(&self.state)?;
        self.install.prune(&[from, to]);
        Ok(())
    }

    /// Records the revert and points the link at `from` again.
    fn revert_self(
        &self,
        from: u64,
        to: u64,
        reason: String,
        unconfirmed: bool,
    ) -> std::io::Result<()> {
        tracing::error!(
            from,
            to,
            "release {to} failed its trial ({reason}); restoring {from}"
        );
        let mut record = ReleaseRecord::load(&self.state)?;
        record.reverted(from, to, reason, unconfirmed);
        record.save(&self.state)?;
        self.install.switch(from)
    }

    /// The restored agent holds a session: a revert for want of one is the release's fault.
    /// Answers whether the record changed.
    pub fn confirm_blame(&self) -> bool {
        let Ok(mut record) = ReleaseRecord::load(&self.state) else {
            return false;
        };
        let Some(UpdateOutcome::Reverted { to, reason, .. }) = &record.last else {
            return false;
        };
        if !record.unconfirmed {
            return false;
        }
        record.never.insert(*to, reason.clone());
        record.unconfirmed = false;
        record.save(&self.state).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fleet_proto::release::{ReleaseBinary, ReleaseManifest, SigningKey};

    struct Machine {
        _dir: tempfile::TempDir,
        releases: Releases,
        files: PathBuf,
        root: SigningKey,
        key: SigningKey,
    }

    fn machine() -> Machine {
        let dir = tempfile::tempdir().unwrap();
        let (opt, state, files) = (
            dir.path().join("opt"),
            dir.path().join("state"),
            dir.path().join("files"),
        );
        for d in [&opt, &state, &files] {
            std::fs::create_dir_all(d).unwrap();
        }
        for name in BINARIES {
            // Scripts that do nothing: the watchdog a take starts runs the old one.
            std::fs::write(opt.join(name), "#!/bin/sh\n# bootstrap\n").unwrap();
            use std::os::unix::fs::PermissionsExt as _;
            let executable = std::fs::Permissions::from_mode(0o755);
            std::fs::set_permissions(opt.join(name), executable).unwrap();
            std::fs::write(files.join(name), format!("#!/bin/sh\n# new {name}\n")).unwrap();
        }
        let root = SigningKey::generate().unwrap().0;
        Machine {
            releases: Releases {
                install: Install::new(&opt),
                state,
                roots: vec![root.public()],
                trial: DEFAULT_TRIAL,
                started_as: 0,
            },
            _dir: dir,
            files,
            root,
            key: SigningKey::generate().unwrap().0,
        }
    }

    impl Machine {
        fn offer(
            &self,
            sequence: u64,
            target: &str,
            expires_at_ms: u64,
            root: &SigningKey,
        ) -> ReleaseOffer {
            let manifest = self.manifest(sequence, target, expires_at_ms);
            signed_offer(&manifest, root, &self.key)
        }

        fn manifest(&self, sequence: u64, target: &str, expires_at_ms: u64) -> ReleaseManifest {
            let binaries = BINARIES
                .iter()
                .map(|name| {
                    let bytes = std::fs::read(self.files.join(name)).unwrap();
                    ReleaseBinary {
                        target: target.into(),
                        name: name.to_string(),
                        sha256: Digest::of(&bytes),
                        size: bytes.len() as u64,
                    }
                })
                .collect();
            ReleaseManifest {
                version: "0.2.0".into(),
                sequence,
                min_sequence: 0,
                expires_at_ms,
                binaries,
                roots: vec![],
                revoked_keys: vec![],
            }
        }

        /// Takes `offer` with the binaries served from `files` (a fetch checks nothing more here).
        fn take(&self, offer: &ReleaseOffer) -> Answer {
            let files = self.files.clone();
            let by_digest = move |digest: &Digest| -> Result<PathBuf, Refusal> {
                (BINARIES.iter())
                    .map(|n| files.join(n))
                    .find(|p| Digest::of(&std::fs::read(p).unwrap()) == *digest)
                    .ok_or_else(|| refused(format!("no content {digest}")))
            };
            self.releases.take(offer, &by_digest)
        }

        /// The refusal's line with `running` still running and the refusal recorded.
        fn refused_after(&self, offer: &ReleaseOffer, running: u64) -> String {
            let refusal = self.take(offer).unwrap_err();
            assert_eq!(self.releases.install.running(), running);
            let record = ReleaseRecord::load(&self.releases.state).unwrap();
            assert!(
                matches!(record.last, Some(UpdateOutcome::Refused { .. })),
                "{record:?}"
            );
            refusal.message
        }

        /// The refusal's line, with nothing installed or switched and the refusal recorded.
        fn refused(&self, offer: &ReleaseOffer) -> String {
            let refusal = self.take(offer).unwrap_err();
            assert_eq!(refusal.class, RefusalClass::Release);
            assert!(
                !self.releases.install.root().join("releases").exists(),
                "nothing installed"
            );
            assert_eq!(self.releases.install.running(), BOOTSTRAP);
            let record = ReleaseRecord::load(&self.releases.state).unwrap();
            assert!(
                matches!(record.last, Some(UpdateOutcome::Refused { .. })),
                "{record:?}"
            );
            refusal.message
        }
    }

    fn signed_offer(
        manifest: &ReleaseManifest,
        root: &SigningKey,
        key: &SigningKey,
    ) -> ReleaseOffer {
        use base64::Engine;
        let bytes = serde_json::to_vec(manifest).unwrap();
        let certified = root.certify(&key.public(), "release");
        ReleaseOffer {
            manifest: base64::engine::general_purpose::STANDARD.encode(&bytes),
            signature: key.sign_manifest(&bytes, &certified),
        }
    }

    const FAR: u64 = u64::MAX;

    #[test]
    fn a_release_signed_under_the_old_root_rotates_it_and_revocations_hold_from_then_on() {
        let m = machine();
        let new_root = SigningKey::generate().unwrap().0;
        let mut rotating = m.manifest(5, TARGET, FAR);
        rotating.roots = vec![new_root.public()];
        let answer = m.take(&signed_offer(&rotating, &m.root, &m.key));
        assert_eq!(answer, Ok(Reply::Updating { from: 0, to: 5 }));
        let record = ReleaseRecord::load(&m.releases.state).unwrap();
        assert_eq!(m.releases.trust(&record).roots, vec![new_root.public()]);
        // The old root no longer certifies a release here; the new one does.
        let line = m.refused_after(&m.offer(6, TARGET, FAR, &m.root), 5);
        assert!(
            line.contains("which is not a root of this fleet (it trusts ed25519:"),
            "{line}"
        );
        let second_key = SigningKey::generate().unwrap().0;
        let mut revoking = m.manifest(6, TARGET, FAR);
        revoking.revoked_keys = vec![m.key.public()];
        let answer = m.take(&signed_offer(&revoking, &new_root, &second_key));
        assert_eq!(answer, Ok(Reply::Updating { from: 5, to: 6 }));
        // The first release key, even certified by the new root, is refused by name.
        let stolen = signed_offer(&m.manifest(7, TARGET, FAR), &new_root, &m.key);
        let line = m.refused_after(&stolen, 6);
        assert_eq!(
            line,
            format!(
                "the release key {} is revoked: sign the release with a key the fleet's root certified since",
                m.key.public()
            )
        );
    }

    #[test]
    fn each_bad_release_is_refused_naming_why_and_nothing_is_installed() {
        let m = machine();
        let stranger = SigningKey::generate().unwrap().0;
        let line = m.refused(&m.offer(5, TARGET, FAR, &stranger));
        assert!(line.contains("which is not a root of this fleet"), "{line}");
        let line = m.refused(&m.offer(5, TARGET, 1, &m.root));
        assert!(
            line.starts_with("the manifest expired at 1 ms since the epoch"),
            "{line}"
        );
        let other = match TARGET {
            "x86_64-unknown-linux-musl" => "aarch64-unknown-linux-musl",
            _ => "x86_64-unknown-linux-musl",
        };
        let line = m.refused(&m.offer(5, other, FAR, &m.root));
        assert_eq!(line, format!("the release has no fleet-agent for {TARGET}"));
        let mut record = ReleaseRecord::load(&m.releases.state).unwrap();
        record.floor = 9;
        record.save(&m.releases.state).unwrap();
        let line = m.refused(&m.offer(5, TARGET, FAR, &m.root));
        assert!(line.contains("sequence 5 is not above 9"), "{line}");
        assert!(line.ends_with("a downgrade is refused"), "{line}");
    }
}
