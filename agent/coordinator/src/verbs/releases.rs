//! The release and rollout commands: `release ...`, `update` and `rollout ...`, and how each
//! prints.
use super::{Place, operate};
use crate::cli::{ReleaseCmd, RolloutCmd, UpdateArgs};
use anyhow::Result;
use fleet_coordinator::commands::{
    Releases, RevokeReleaseKey, SetRollout, ShowRollout, StartRollout, TakeRelease, TrustRoot,
    UpdateNode,
};
use fleet_coordinator::rollout::{Rollout, RolloutPlan, RolloutState};
use fleet_coordinator::{self as coordinator};

pub fn release(place: &Place, command: ReleaseCmd) -> Result<()> {
    use fleet_coordinator::release;
    match command {
        ReleaseCmd::Trust { root } => {
            let roots = operate(place, TrustRoot { root })?;
            for root in roots {
                println!("{root}");
            }
        }
        ReleaseCmd::Revoke { key } => {
            let trust = operate(place, RevokeReleaseKey { key })?;
            for key in trust.revoked {
                println!("revoked {key}");
            }
        }
        ReleaseCmd::Add { dir } => {
            let progress = fleet_coordinator::progress::Progress::on_terminal();
            let offered = release::offer(&dir, &coordinator::blobs(&place.data), &progress)?;
            let spinner = progress.spinner(
                "checking the release and copying its binaries to the fleet's coordinators",
            );
            let answer = operate(place, TakeRelease { offer: offered });
            spinner.finish_and_clear();
            let taken = answer?;
            let m = &taken.manifest;
            let what = if taken.new { "took in" } else { "already had" };
            println!(
                "{what} release {} (sequence {}, {} binaries)",
                m.version,
                m.sequence,
                m.binaries.len()
            );
        }
        ReleaseCmd::List { json } => {
            let releases = operate(place, Releases {})?;
            if json {
                let manifests: Vec<_> = releases.iter().map(|r| &r.manifest_read).collect();
                println!("{}", serde_json::to_string_pretty(&manifests)?);
            } else {
                println!(
                    "{:<10} {:<12} {:<9} {:<24} BINARIES",
                    "SEQUENCE", "VERSION", "FLOOR", "EXPIRES (UNIX MS)"
                );
                for r in &releases {
                    let m = &r.manifest_read;
                    println!(
                        "{:<10} {:<12} {:<9} {:<24} {}",
                        m.sequence,
                        m.version,
                        m.min_sequence,
                        m.expires_at_ms,
                        m.binaries.len()
                    );
                }
            }
        }
        ReleaseCmd::Keygen { out } => println!("{}", release::keygen(&out)?),
        ReleaseCmd::Certify {
            root,
            key,
            name,
            out,
        } => {
            release::certify(&root, &key, &name, &out)?;
            eprintln!(
                "certified {key} as the release key {name:?} in {}",
                out.display()
            );
        }
        ReleaseCmd::Sign(s) => {
            let request = release::SignRequest {
                key: s.key,
                certificate: s.cert,
                dir: s.dir.clone(),
                version: s.version,
                sequence: s.sequence,
                min_sequence: s.min_sequence,
                expires_at_ms: fleet_proto::clock::now_ms() + s.expires_in.as_millis() as u64,
                roots: s.rotate_roots,
                revoked_keys: s.revoke,
            };
            let manifest = release::sign(&request)?;
            eprintln!(
                "signed release {} (sequence {}, {} binaries) in {}",
                manifest.version,
                manifest.sequence,
                manifest.binaries.len(),
                s.dir.display()
            );
        }
        ReleaseCmd::Verify { dir, roots } => {
            let manifest = release::verify_dir(&dir, &roots, fleet_proto::clock::now_ms())?;
            println!("{}", serde_json::to_string_pretty(&manifest)?);
        }
    }
    Ok(())
}

/// `update --node N [--release SEQUENCE]`.
pub fn update(place: &Place, u: UpdateArgs) -> Result<()> {
    let sent = operate(
        place,
        UpdateNode {
            node: u.node,
            release: u.release,
        },
    )?;
    println!(
        "{} restarts from release {} into {} on trial",
        sent.node_id, sent.from, sent.to
    );
    Ok(())
}

/// The fleet's rollout, or the one line saying none was started.
fn current(place: &Place) -> Result<Rollout> {
    operate(place, ShowRollout {})?.ok_or_else(|| {
        anyhow::anyhow!("no rollout was started: see `fleet-coordinator rollout start --help`")
    })
}

pub fn rollout(place: &Place, command: RolloutCmd) -> Result<()> {
    let (to, json) = match command {
        RolloutCmd::Start(s) => {
            let plan = RolloutPlan {
                release: s.release,
                canaries: s.canaries,
                waves: s.waves.0,
                wait_ms: s.wait.as_millis() as u64,
                halt_at: s.halt_at,
                selector: s.selector,
            };
            let rollout = operate(place, StartRollout { plan })?;
            print_rollout(&rollout);
            return Ok(());
        }
        RolloutCmd::Status { watch: true, .. } => return watch_rollout(place),
        RolloutCmd::Status { json, .. } => (None, json),
        RolloutCmd::Pause => (Some(RolloutState::Paused), false),
        RolloutCmd::Resume => (Some(RolloutState::Running), false),
        RolloutCmd::Abort => (Some(RolloutState::Aborted), false),
    };
    let rollout = match to {
        Some(to) => operate(place, SetRollout { to })?,
        None => current(place)?,
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&rollout)?);
    } else {
        print_rollout(&rollout);
    }
    Ok(())
}

/// `rollout status --watch`: follows the rollout until it is done (Ok), halted or aborted (an
/// error saying why); a bar on a terminal, otherwise a line each time the summary changes.
fn watch_rollout(place: &Place) -> Result<()> {
    let progress = fleet_coordinator::progress::Progress::on_terminal();
    let bar = progress.machines(0);
    let mut said = String::new();
    loop {
        let rollout = current(place)?;
        let summary = rollout.summary();
        if progress.drawn() {
            let counts = rollout.counts();
            bar.set_length(counts.sent);
            bar.set_position(counts.kept);
            bar.set_message(summary.clone());
        } else if summary != said {
            println!("{summary}");
        }
        said = summary;
        match &rollout.state {
            RolloutState::Running | RolloutState::Paused => {}
            RolloutState::Done => {
                bar.finish_and_clear();
                print_rollout(&rollout);
                return Ok(());
            }
            RolloutState::Halted { reason } => {
                bar.finish_and_clear();
                anyhow::bail!(
                    "the rollout of release {} halted: {reason}",
                    rollout.plan.release
                )
            }
            RolloutState::Aborted => {
                bar.finish_and_clear();
                anyhow::bail!(
                    "the rollout of release {} was aborted",
                    rollout.plan.release
                )
            }
        }
        std::thread::sleep(std::time::Duration::from_secs(1));
    }
}

fn print_rollout(rollout: &fleet_coordinator::rollout::Rollout) {
    use fleet_coordinator::rollout::{MachineOutcome, RolloutState, state_word};
    let plan = &rollout.plan;
    println!(
        "release {}: {} at stage {} (canaries {}, waves {:?}%, halt above {}%)",
        plan.release,
        state_word(&rollout.state),
        rollout.stage,
        plan.canaries,
        plan.waves,
        plan.halt_at
    );
    if let RolloutState::Halted { reason } = &rollout.state {
        println!("halted: {reason}");
    }
    println!(
        "{:<8} {:>8} {:>8} {:>8} {:>8}",
        "STAGE", "MACHINES", "KEPT", "FAILED", "PENDING"
    );
    let stages = (0..=plan.waves.len()).chain([usize::MAX]);
    for stage in stages {
        let of: Vec<_> = rollout
            .machines
            .values()
            .filter(|m| m.stage == stage)
            .collect();
        if of.is_empty() {
            continue;
        }
        let count = |f: fn(&MachineOutcome) -> bool| of.iter().filter(|m| f(&m.outcome)).count();
        let name = match stage {
            0 => "canaries".to_string(),
            usize::MAX => "resumed".to_string(),
            k => format!("wave {k}"),
        };
        println!(
            "{:<8} {:>8} {:>8} {:>8} {:>8}",
            name,
            of.len(),
            count(|o| matches!(o, MachineOutcome::Kept)),
            count(|o| matches!(o, MachineOutcome::Failed { .. })),
            count(|o| matches!(o, MachineOutcome::Pending)),
        );
    }
}
