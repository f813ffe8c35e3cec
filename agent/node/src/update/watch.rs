//! `fleet-agent watch-update`: the watchdog of one trial, run from the old release's binary and
//! detached from the agent. While the trial lasts it watches the agent's process: if it exits
//! (a release that crashes at its start or later in its trial), the old release is restored at
//! once and the unit's restart starts it; if the new agent neither keeps nor reverts by the
//! deadline (it hangs), the old release is restored and the agent killed. It exits as soon as
//! the trial ended either way.
use super::{Install, ReleaseRecord};
use fleet_proto::clock::now_ms;
use fleet_proto::release::UpdateOutcome;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, clap::Args)]
pub struct WatchArgs {
    #[arg(long)]
    pub state: PathBuf,
    #[arg(long)]
    pub install_dir: PathBuf,
    /// The agent's process, which execs the new release
    #[arg(long)]
    pub pid: i32,
    #[arg(long)]
    pub from: u64,
    #[arg(long)]
    pub to: u64,
    /// When to give up on the new agent (Unix ms)
    #[arg(long)]
    pub deadline_ms: u64,
}

/// Whether the process lives (a zombie does not).
fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state is the first field after the command's closing parenthesis.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

/// Watches one trial to its end; the exit status is 0 unless the record could not be written.
pub fn watch(args: &WatchArgs) -> std::io::Result<()> {
    let install = Install::new(&args.install_dir);
    let (from, to) = (args.from, args.to);
    loop {
        let record = ReleaseRecord::load(&args.state)?;
        let on_trial = matches!(record.last, Some(UpdateOutcome::Trial { to: t, .. }) if t == to);
        if !on_trial {
            return Ok(());
        }
        let reason = if !alive(args.pid) {
            "the new agent exited during its trial"
        } else if now_ms() >= args.deadline_ms {
            "the new agent neither kept nor reverted its release by the end of its trial"
        } else {
            std::thread::sleep(Duration::from_millis(100));
            continue;
        };
        tracing::error!(
            from,
            to,
            "release {to} failed its trial ({reason}); restoring {from}"
        );
        let mut record = record;
        record.reverted(from, to, reason.to_string(), false);
        record.save(&args.state)?;
        install.switch(from)?;
        if alive(args.pid) {
            // Hung: the unit's restart starts the restored agent.
            let _ = rustix::process::kill_process(
                rustix::process::Pid::from_raw(args.pid).expect("a live pid is positive"),
                rustix::process::Signal::KILL,
            );
        }
        return Ok(());
    }
}
