//! The run commands: `run`, `status`, `collect`, `replicate`, `stop` and `policy`, and how
//! each prints.
use super::{Place, operate};
use crate::cli::{CollectArgs, PolicyArgs, ReplicateArgs, RunArgs, StatusArgs, StopArgs};
use anyhow::{Context, Result};
use fleet_coordinator::commands::{Collect, CopyTargetsOf, Status, Stop};
use fleet_coordinator::push::CopyTargets;
use fleet_coordinator::runs::{ReplicateRequest, RunRequest, RunView};
use fleet_coordinator::{self as coordinator, StoreLocation, operator};
use fleet_proto::run::RunOptions;
use std::path::Path;

/// `run`: imports the program and inputs, then records the set; prints its id.
pub fn run(place: &Place, r: RunArgs) -> Result<()> {
    let data = &place.data;
    // On a shared store, a program kept in a folder no coordinator serves could reach no
    // node: refused before anything is imported.
    if matches!(place.store, StoreLocation::Postgres(_)) && !operator::served(data) {
        anyhow::bail!(
            "no coordinator serves {}: a run's program would stay in this folder, where no coordinator of the fleet can send it to a node; pass the --data folder of a serving coordinator, or start `fleet-coordinator serve` on this one",
            data.display()
        );
    }
    let targets = match operator::served(data) {
        true => copy_targets(place)?,
        false => Default::default(),
    };
    let request = run_request(&r, data, &targets)?;
    let set = operate(place, request)?;
    println!("{}", set.set_id);
    Ok(())
}

/// `collect --run R --path P --out FILE`.
pub fn collect(place: &Place, c: CollectArgs) -> Result<()> {
    let request = Collect {
        run: c.run.clone(),
        path: c.path.clone(),
        max_bytes: c.max_bytes,
    };
    let answer = operate(place, request)?;
    let blobs = coordinator::blobs(&place.data);
    blobs
        .take_collected(&answer.upload, &answer.digest, &c.out)
        .with_context(|| format!("cannot write {}", c.out.display()))?;
    println!("{}", answer.digest);
    Ok(())
}

/// `replicate --node N (--file FILE | --digest D --url URL)`.
pub fn replicate(place: &Place, r: ReplicateArgs) -> Result<()> {
    let (digest, ticket) = match (&r.file, &r.digest) {
        (Some(file), _) => {
            let blobs = coordinator::blobs(&place.data);
            let (digest, _) = blobs.import(file).with_context(|| {
                format!(
                    "cannot add --file {} to the blob store {}",
                    file.display(),
                    blobs.root().display()
                )
            })?;
            (digest, true)
        }
        (None, Some(digest)) => (
            fleet_proto::Digest::parse(digest)
                .map_err(|_| anyhow::anyhow!("--digest {digest} is not sha256:<64 hex>"))?,
            false,
        ),
        (None, None) => {
            anyhow::bail!("pass --file FILE, or --digest sha256:HEX with --url")
        }
    };
    let request = ReplicateRequest {
        node: r.node.clone(),
        digest,
        ticket,
        url: r.url.clone(),
        expires_in_ms: r.expires_in.map(|d| d.as_millis() as u64),
    };
    let replicated = operate(place, request)?;
    println!("{}", serde_json::to_string(&replicated)?);
    Ok(())
}

/// `stop --run R`.
pub fn stop(place: &Place, s: StopArgs) -> Result<()> {
    operate(place, Stop { run: s.run.clone() })?;
    println!("stopped {}", s.run);
    Ok(())
}

/// Sets, clears or shows the signing policy in the data folder; every later `run --image`, on a
/// serving coordinator or not, reads it.
pub fn policy(data: &Path, args: &PolicyArgs) -> Result<()> {
    use fleet_coordinator::signing::{SigningPolicy, signers_path};
    if args.clear {
        SigningPolicy::clear(data)?;
        println!("the fleet runs any image: no signature required");
        return Ok(());
    }
    if !args.require_signature.is_empty() {
        SigningPolicy::from_files(&args.require_signature)?.save(data)?;
    }
    match SigningPolicy::load(data)? {
        Some(policy) => {
            for key in policy.key_ids() {
                println!("{key}");
            }
        }
        None => println!(
            "no signature required ({} is absent): set keys with --require-signature PUB",
            signers_path(data).display()
        ),
    }
    Ok(())
}

/// A `--where` expression, refused in one line that names what it knows.
pub fn selector(text: Option<&str>) -> Result<Option<fleet_coordinator::placement::Selector>> {
    (text.map(fleet_coordinator::placement::Selector::parse))
        .transpose()
        .map_err(anyhow::Error::msg)
}

/// The run request, with the program and inputs streamed into the blob store first: this
/// command shares the data folder with the serving coordinator, so it writes the blobs itself,
/// one streamed copy of any size, and sends only their digests.
/// The coordinators a `run` pushes its content to while it imports it.
fn copy_targets(place: &Place) -> Result<CopyTargets> {
    operate(place, CopyTargetsOf {})
}

/// `targets`: the coordinators each imported file is pushed to as it is read.
fn run_request(
    r: &RunArgs,
    data: &Path,
    targets: &fleet_coordinator::push::CopyTargets,
) -> Result<RunRequest> {
    // Read before any file is added to the blob store, so a bad expression changes nothing.
    let place = selector(r.where_.as_deref())?;
    let prefer = (r.prefer.as_deref())
        .map(str::parse::<fleet_coordinator::placement::Preference>)
        .transpose()
        .map_err(anyhow::Error::msg)?;
    let blobs = &coordinator::blobs(data);
    let import = |flag: &str, path: &std::path::Path| {
        fleet_coordinator::push::import_copying(data, blobs, path, targets)
            .map(|(digest, _)| digest)
            .with_context(|| {
                format!(
                    "cannot add {flag} {} to the blob store {}",
                    path.display(),
                    blobs.root().display()
                )
            })
    };
    let mut inputs = Vec::new();
    for (name, file) in &r.inputs {
        inputs.push((name.clone(), import("--input", std::path::Path::new(file))?));
    }
    Ok(RunRequest {
        node: r.node.clone(),
        all: r.all,
        place,
        count: r.count,
        prefer,
        wait_for_match: r.wait_for_match,
        retry_lost: r.retry_lost,
        program: match &r.program {
            Some(program) => Some(import("--program", program)?),
            None => None,
        },
        image: r.image.clone(),
        registry_auth: match &r.registry_auth {
            Some(file) => Some(registry_auth(file)?),
            None => None,
        },
        options: RunOptions {
            argv: r
                .args
                .iter()
                .map(|a| {
                    fleet_proto::Bytes(
                        std::os::unix::ffi::OsStrExt::as_bytes(a.as_os_str()).to_vec(),
                    )
                })
                .collect(),
            timeout_ms: r.timeout.map(|t| t.as_millis() as u64),
            output_limit: r.output_limit,
            env: r.env.clone(),
            inputs,
            resources: Default::default(),
        },
        repeat: r.repeat,
        #[cfg(debug_assertions)]
        raw_command: r.raw_command.clone(),
    })
}

/// Reads `--registry-auth FILE`: `{"username": ..., "password": ...}`. The error names the file,
/// never its content.
fn registry_auth(file: &std::path::Path) -> Result<fleet_proto::run::RegistryAuth> {
    let bytes = std::fs::read(file)
        .with_context(|| format!("cannot read --registry-auth {}", file.display()))?;
    serde_json::from_slice(&bytes).map_err(|_| {
        anyhow::anyhow!(
            "--registry-auth {} is not JSON with a \"username\" and a \"password\"; write it as {{\"username\": \"USER\", \"password\": \"PASS\"}}",
            file.display()
        )
    })
}

pub fn status(place: &Place, s: StatusArgs) -> Result<()> {
    let request = Status {
        set: s.set.clone(),
        run: s.run.clone(),
    };
    let rows: Vec<RunView> = loop {
        let rows = operate(place, request.clone())?;
        if !s.poll || rows.iter().all(|r| r.state.is_final()) {
            break rows;
        }
        std::thread::sleep(std::time::Duration::from_millis(500));
    };
    if s.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    println!(
        "{:<16} {:<20} {:<9} {:<10} ERROR",
        "RUN", "NODE", "STATE", "EXIT"
    );
    for r in rows {
        let exit = match &r.outcome {
            Some(o) if o.timed_out => "timed out".to_string(),
            Some(o) if o.stopped => "stopped".to_string(),
            Some(o) if o.oom_killed == Some(true) => "oom".to_string(),
            Some(o) => match (o.exit_code, o.signal) {
                (Some(code), _) => code.to_string(),
                (None, Some(signal)) => format!("signal {signal}"),
                _ => "-".to_string(),
            },
            None => "-".to_string(),
        };
        println!(
            "{:<16} {:<20} {:<9} {:<10} {}",
            r.run_id,
            r.node_id,
            r.state,
            exit,
            match (&r.error, &r.retried_as, &r.waiting_for) {
                (Some(error), Some(next), _) => format!("{error} (run again as {next})"),
                (Some(error), None, _) => error.clone(),
                (None, _, Some(why)) => why.to_string(),
                (None, _, None) => String::new(),
            }
        );
    }
    Ok(())
}
