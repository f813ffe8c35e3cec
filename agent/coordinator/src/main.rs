//! The `fleet-coordinator` binary: tokens, user data, serving, and the operator's run commands.
mod cli;

use anyhow::{Context, Result};
use clap::Parser;
use cli::{Cli, Command, NodesArgs, RunArgs, ServeArgs, StatusArgs, TokenArgs};
use fleet_cli::binary;
use fleet_coordinator::runs::{RunRequest, RunView};
use fleet_coordinator::store::NodeProtocol;
use fleet_coordinator::{self as coordinator, Coordinator, NodeView, StoreLocation, TokenRequest};
use fleet_coordinator::{metrics, operator, serve, userdata};
use fleet_proto::joinfile::JoinFile;
use fleet_proto::protocol::NodeEnd;
use fleet_proto::run::RunOptions;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

// jemalloc, not musl's allocator: musl's kept what a crowd of sessions or a dispatch freed, so
// the RSS climbed with every restart in the fleet ("The coordinator's allocator" in
// ARCHITECTURE.md).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() {
    let cli = Cli::parse();
    binary::run("fleet-coordinator", cli.log_format, || run_coordinator(cli));
}

/// The data folder (key, operator socket, embedded store) and where the store is.
struct Place {
    data: std::path::PathBuf,
    store: StoreLocation,
}

/// How long an operator command or `serve` waits for the other to let go of the store.
const STORE_PATIENCE: Duration = Duration::from_secs(10);

fn run_coordinator(args: Cli) -> Result<()> {
    let store = match &args.store {
        Some(url) => StoreLocation::parse(url)?,
        None => StoreLocation::Embedded,
    };
    let place = Place {
        data: args.data,
        store,
    };
    let data = &place.data;
    match args.command {
        Command::Token(t) if t.count == 1 => {
            let join = mint(&place, token_request(&t.token))?;
            println!("{}", serde_json::to_string_pretty(&join)?);
        }
        Command::Token(t) => {
            let request = operator::Request::Tokens {
                request: token_request(&t.token),
                count: t.count as usize,
            };
            let operator::Answer::Tokens(joins) = operate(&place, request)? else {
                return Err(mismatch("token --count"));
            };
            let mut out = std::io::stdout().lock();
            for join in joins {
                writeln!(out, "{}", serde_json::to_string(&join)?)?;
            }
        }
        Command::UserData(u) => {
            let bundles = u.bundles.unwrap_or_else(|| data.join("bundles"));
            let bundle = coordinator::bundle_path(&bundles, &u.arch);
            let sum = coordinator::file_sha256(&bundle).map_err(|cause| {
                coordinator::CoordinatorError::Bundle {
                    path: bundle.clone(),
                    cause,
                }
            })?;
            let mut request = token_request(&u.token);
            request.bundle_sha256 = Some(sum);
            let join = mint(&place, request)?;
            print!("{}", userdata::render(&join, &u.arch));
        }
        Command::Nodes(n) => {
            let filter = coordinator::NodeFilter {
                status: (n.state.as_deref().map(str::parse))
                    .transpose()
                    .map_err(anyhow::Error::msg)?,
                place: selector(n.where_.as_deref())?,
            };
            let request = operator::Request::Nodes { filter };
            let operator::Answer::Nodes(nodes) = operate(&place, request)? else {
                return Err(mismatch("nodes"));
            };
            print_nodes(&n, nodes)?
        }
        Command::Serve(s) => serve_coordinator(&place, s)?,
        Command::Run(r) => {
            // On a shared store, a program kept in a folder no coordinator serves could reach no
            // node: refused before anything is imported.
            if matches!(place.store, StoreLocation::Postgres(_)) && !operator::served(data) {
                anyhow::bail!(
                    "no coordinator serves {}: a run's program would stay in this folder, where no coordinator of the fleet can send it to a node; pass the --data folder of a serving coordinator, or start `fleet-coordinator serve` on this one",
                    data.display()
                );
            }
            let targets = match operator::served(data) {
                true => copy_targets(&place)?,
                false => Default::default(),
            };
            let request = run_request(&r, data, &targets)?;
            let operator::Answer::Run(set) = operate(&place, operator::Request::Run(request))?
            else {
                return Err(mismatch("run"));
            };
            println!("{}", set.set_id);
        }
        Command::Status(s) => print_status(&place, &s)?,
        Command::Collect(c) => {
            let request = operator::Request::Collect {
                run: c.run.clone(),
                path: c.path.clone(),
                max_bytes: c.max_bytes,
            };
            let operator::Answer::Collected(answer) = operate(&place, request)? else {
                return Err(mismatch("collect"));
            };
            let blobs = coordinator::blobs(data);
            blobs
                .take_collected(&answer.upload, &answer.digest, &c.out)
                .with_context(|| format!("cannot write {}", c.out.display()))?;
            println!("{}", answer.digest);
        }
        Command::Replicate(r) => {
            let (digest, ticket) = match (&r.file, &r.digest) {
                (Some(file), _) => {
                    let blobs = coordinator::blobs(data);
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
            let request = operator::Request::Replicate(fleet_coordinator::runs::ReplicateRequest {
                node: r.node.clone(),
                digest,
                ticket,
                url: r.url.clone(),
                expires_in_ms: r.expires_in.map(|d| d.as_millis() as u64),
            });
            let operator::Answer::Replicated(replicated) = operate(&place, request)? else {
                return Err(mismatch("replicate"));
            };
            println!("{}", serde_json::to_string(&replicated)?);
        }
        Command::Policy(p) => policy(data, &p)?,
        Command::Label(l) => {
            let request = operator::Request::Label {
                node: l.node.clone(),
                set: l.labels.clone(),
                remove: l.remove.clone(),
            };
            let node = changed_node(&place, request, "label")?;
            let labels: Vec<String> = (node.labels.iter())
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            println!("{} {}", node.id, labels.join(","));
        }
        Command::Capacity(c) => {
            let request = operator::Request::Capacity {
                node: c.node.clone(),
                runs: c.runs,
            };
            let node = changed_node(&place, request, "capacity")?;
            match node.capacity {
                Some(k) => println!(
                    "{} takes {k} run(s) at once ({} out)",
                    node.id, node.runs_out
                ),
                None => println!(
                    "{} takes runs without a limit ({} out)",
                    node.id, node.runs_out
                ),
            }
        }
        Command::Drain(d) => {
            let request = operator::Request::Drain {
                node: d.node.clone(),
                undrain: d.undrain,
            };
            let node = changed_node(&place, request, "drain")?;
            match node.drain {
                None => println!("{} takes new runs again", node.id),
                Some(_) => println!(
                    "{} is {}: it takes no new run ({} out)",
                    node.id, node.status, node.runs_out
                ),
            }
        }
        Command::Retire(r) => end_node(&place, &r.node, NodeEnd::Retired, r.discard)?,
        Command::Revoke(r) => end_node(&place, &r.node, NodeEnd::Revoked, false)?,
        Command::Release(r) => release(&place, r)?,
        Command::Rollout(r) => rollout(&place, r)?,
        Command::Update(u) => {
            let request = operator::Request::Update {
                node: u.node.clone(),
                release: u.release,
            };
            let operator::Answer::Updating(sent) = operate(&place, request)? else {
                return Err(mismatch("update"));
            };
            println!(
                "{} restarts from release {} into {} on trial",
                sent.node_id, sent.from, sent.to
            );
        }
        Command::Check(c) => {
            let request = operator::Request::Check(fleet_coordinator::check::CheckNodes {
                node: c.node.clone(),
                ask: fleet_proto::check::CheckRequest {
                    registry: c.registry.clone(),
                    min_disk_bytes: c.min_disk,
                },
            });
            let operator::Answer::Checked(checked) = operate(&place, request)? else {
                return Err(mismatch("check"));
            };
            print_checks(&checked, c.json)?;
        }
        Command::Forget(f) => {
            let request = operator::Request::Forget {
                node: f.node.clone(),
            };
            let node = changed_node(&place, request, "forget")?;
            println!("{} is forgotten", node.id);
        }
        Command::Stop(s) => {
            let operator::Answer::Stopped =
                operate(&place, operator::Request::Stop { run: s.run.clone() })?
            else {
                return Err(mismatch("stop"));
            };
            println!("stopped {}", s.run);
        }
    }
    Ok(())
}

/// Sets, clears or shows the signing policy in the data folder; every later `run --image`, on a
/// serving coordinator or not, reads it.
fn policy(data: &std::path::Path, args: &cli::PolicyArgs) -> Result<()> {
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
fn selector(text: Option<&str>) -> Result<Option<fleet_coordinator::placement::Selector>> {
    (text.map(fleet_coordinator::placement::Selector::parse))
        .transpose()
        .map_err(anyhow::Error::msg)
}

/// The run request, with the program and inputs streamed into the blob store first: this
/// command shares the data folder with the serving coordinator, so it writes the blobs itself,
/// one streamed copy of any size, and sends only their digests.
/// The coordinators a `run` pushes its content to while it imports it.
fn copy_targets(place: &Place) -> Result<fleet_coordinator::push::CopyTargets> {
    match operate(place, operator::Request::CopyTargets)? {
        operator::Answer::CopyTargets(targets) => Ok(targets),
        _ => Err(mismatch("copy targets")),
    }
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

fn print_status(place: &Place, s: &StatusArgs) -> Result<()> {
    let request = operator::Request::Status {
        set: s.set.clone(),
        run: s.run.clone(),
    };
    let rows: Vec<RunView> = loop {
        let operator::Answer::Status(rows) = operate(place, request.clone())? else {
            return Err(mismatch("status"));
        };
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

fn token_request(t: &TokenArgs) -> TokenRequest {
    TokenRequest {
        ttl_ms: t.ttl.as_millis() as u64,
        name: t.name.clone(),
        labels: t.labels.iter().cloned().collect(),
        address: t.address.clone(),
        bundle_sha256: t.bundle_sha256.clone(),
    }
}

/// Through the serving coordinator's socket when it runs, else on the store directly. The store
/// is held only for this one request; a `serve` starting meanwhile waits for it (see
/// [`STORE_PATIENCE`]), and when `serve` holds it first this command goes through its socket.
fn operate(place: &Place, request: operator::Request) -> Result<operator::Answer> {
    let data = &place.data;
    let deadline = std::time::Instant::now() + STORE_PATIENCE;
    let response = loop {
        match operator::call(data, &request) {
            Some(Ok(answer)) => break answer,
            // The serving coordinator went away mid-request: a read is asked again (of the next
            // one, or of the store); a change is not, since it may have been applied.
            Some(Err(_)) if request.is_read_only() && std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            Some(Err(e)) => {
                return Err(e).context(
                    "the serving coordinator did not answer on its socket; check with `status` whether the request was applied",
                );
            }
            None => {}
        }
        if place.store == StoreLocation::Embedded && data.join(coordinator::POSTGRES_MARK).exists()
        {
            anyhow::bail!(
                "no coordinator answers on {}'s socket, and its fleet's store is in PostgreSQL: start `fleet-coordinator serve` on it again, or pass --store postgres://... to act on the store directly",
                data.display()
            );
        }
        match Coordinator::open(data, &place.store) {
            Ok(coordinator) => {
                break binary::async_runtime()?.block_on(operator::handle(
                    Arc::new(coordinator),
                    None,
                    request,
                ));
            }
            // `serve` holds the store and is about to open its socket.
            Err(coordinator::CoordinatorError::Store(
                fleet_coordinator::store::StoreError::Locked(_),
            )) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(e.into()),
        }
    };
    match response {
        operator::Response::Ok(v) => Ok(v),
        operator::Response::Error(e) => Err(anyhow::anyhow!(e)),
    }
}

/// One row per node and check; fails (exit 1) naming how many nodes failed a check.
fn print_checks(checked: &[fleet_coordinator::check::NodeChecks], json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(checked)?);
    } else {
        println!(
            "{:<20} {:<12} {:<9} {:<8} DETAIL",
            "NODE", "NAME", "CHECK", "RESULT"
        );
        for node in checked {
            for row in &node.rows {
                println!(
                    "{:<20} {:<12} {:<9} {:<8} {}",
                    node.node_id,
                    node.name.as_deref().unwrap_or("-"),
                    row.check.as_str(),
                    row.verdict.as_str(),
                    row.detail
                );
            }
        }
    }
    let failed = checked.iter().filter(|n| !n.passed()).count();
    if failed > 0 {
        anyhow::bail!(
            "{failed} of {} node(s) failed a check: see the rows marked fail",
            checked.len()
        );
    }
    Ok(())
}

/// Sends an operator's change to a node and reads back the node as it now stands.
/// Retires or revokes a node and says what became of it.
fn end_node(place: &Place, node: &str, end: NodeEnd, discard: bool) -> Result<()> {
    let request = operator::Request::End {
        node: node.to_string(),
        end,
        discard,
    };
    let operator::Answer::Ended { node, lost } = operate(place, request)? else {
        return Err(mismatch(end.as_str()));
    };
    println!(
        "{} is {}: its key is refused from now on ({lost} run(s) ended lost)",
        node.id,
        end.as_str()
    );
    Ok(())
}

fn changed_node(place: &Place, request: operator::Request, what: &str) -> Result<Box<NodeView>> {
    let operator::Answer::Node(node) = operate(place, request)? else {
        return Err(mismatch(what));
    };
    Ok(node)
}

fn print_nodes(args: &NodesArgs, nodes: Vec<NodeView>) -> Result<()> {
    if args.json {
        println!("{}", serde_json::to_string_pretty(&nodes)?);
        return Ok(());
    }
    println!(
        "{:<20} {:<8} {:<16} {:<8} {:>4} {:>4} {:>6} {:<8} {:<10} {:<8} {:<8} {:<9} {:<14} {:<16} PUBLIC KEY",
        "ID",
        "STATE",
        "NAME",
        "ARCH",
        "CPUS",
        "GPUS",
        "RUNS",
        "IDLE",
        "VERSION",
        "PROTOCOL",
        "RELEASE",
        "UPDATE",
        "HEARTBEAT",
        "LABELS"
    );
    let now = fleet_proto::clock::now_ms();
    let ago = |t: u64| format!("{} s", now.saturating_sub(t) / 1000);
    for n in nodes {
        let facts = n.facts.as_ref();
        let release = facts.and_then(|f| f.release.as_ref());
        let labels: Vec<String> = n.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        println!(
            "{:<20} {:<8} {:<16} {:<8} {:>4} {:>4} {:>6} {:<8} {:<10} {:<8} {:<8} {:<9} {:<14} {:<16} {}",
            n.id,
            n.status,
            n.name.as_deref().unwrap_or("-"),
            facts.map_or("-", |f| f.arch.as_str()),
            facts.map_or(0, |f| f.cpus),
            facts.map_or(0, |f| f.accelerators.len()),
            // Out of its capacity, when it has one: `3/4`.
            n.capacity
                .map_or(n.runs_out.to_string(), |c| format!("{}/{c}", n.runs_out)),
            n.idle_since_ms.map_or("-".into(), ago),
            facts.map_or("-", |f| f.agent_version.as_str()),
            match n.protocol {
                Some(NodeProtocol::Speaks { version }) => version.to_string(),
                Some(NodeProtocol::Refused(_)) => "refused".into(),
                None => "-".into(),
            },
            release.map_or("-".into(), |r| r.sequence.to_string()),
            release
                .and_then(|r| r.update.as_ref())
                .map_or("-", update_word),
            n.last_heartbeat_ms
                .map_or("never".into(), |t| format!("{} ago", ago(t))),
            if labels.is_empty() {
                "-".into()
            } else {
                labels.join(",")
            },
            // Why it is not served, where something says so; else its key.
            match (&n.error, n.protocol) {
                (Some(error), _) => error.clone(),
                (None, Some(refused @ NodeProtocol::Refused(_))) => refused.to_string(),
                (None, _) => n.public_key.clone(),
            }
        );
    }
    Ok(())
}

/// How long a stopping coordinator waits for its store calls still running before it exits.
const EXIT_PATIENCE: std::time::Duration = std::time::Duration::from_secs(1);

fn serve_coordinator(place: &Place, args: ServeArgs) -> Result<()> {
    // Two heartbeats fit in a lease, so one lost beat never loses a node.
    if args.heartbeat * 2 >= args.lease {
        anyhow::bail!(
            "--heartbeat {} is at or above half of --lease {}: a node would be lost between two heartbeats; give --lease more than twice the heartbeat",
            fleet_cli::duration::human(args.heartbeat),
            fleet_cli::duration::human(args.lease)
        );
    }
    let data = &place.data;
    let coordinator = Arc::new(Coordinator::open_patiently(
        data,
        &place.store,
        STORE_PATIENCE,
    )?);
    (place.store.mark(data))
        .with_context(|| format!("cannot record the store's kind in {}", data.display()))?;
    let mut config = serve::ServeConfig {
        advertise: String::new(),
        bundles: args.bundles.unwrap_or_else(|| data.join("bundles")),
        heartbeat: args.heartbeat,
        lease: args.lease,
        max_session_validity: args.max_session_validity,
        waiting_timeout: args.waiting_timeout,
        max_connections: (args.max_connections.map(|n| n as usize))
            .unwrap_or_else(default_max_connections),
        shutdown_grace: args.shutdown_grace,
        content_copies: args.content_copies as usize,
        fetch_window: args.fetch_window as usize,
    };
    // Before the runtime: the store's calls block.
    match coordinator.store().tuning_advice() {
        Ok(Some(advice)) => tracing::warn!("{advice}"),
        Ok(None) => {}
        Err(e) => tracing::warn!("cannot read the store's settings: {e}"),
    }
    let runtime = binary::async_runtime_lending(SERVE_BLOCKING_THREADS)?;
    let served = runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(&args.listen)
            .await
            .with_context(|| format!("cannot listen on {}", args.listen))?;
        let local = listener.local_addr()?.to_string();
        let advertise = args.advertise.unwrap_or_else(|| local.clone());
        config.advertise = advertise.clone();
        tracing::info!(listen = %local, key = %coordinator.public_key_text(), data = %data.display(), store = %coordinator.store().location(), "coordinator serving");
        let metrics = bind_metrics(&args.metrics_listen, args.metrics_auth.as_deref()).await?;
        let socket = operator::bind(data).context("cannot open the operator socket")?;
        let socket = tokio::spawn(operator::listen(socket, coordinator.clone(), Some(advertise)));
        let (stop_metrics, metrics_stop) = tokio::sync::oneshot::channel::<()>();
        if let Some(metrics) = metrics {
            let addr = metrics.local_addr()?;
            tracing::info!(%addr, "serving metrics on http://{addr}/metrics (and /healthz, /readyz)");
            let stopped = async move {
                let _ = metrics_stop.await;
            };
            tokio::spawn(metrics::serve_metrics(coordinator.clone(), metrics, stopped));
        }
        println!("listening on {local}");
        let served = serve::serve(coordinator.clone(), listener, config, binary::stop_signal()).await;
        drop(stop_metrics);
        socket.abort();
        let _ = std::fs::remove_file(operator::socket_path(data));
        served.context("the coordinator stopped")
    });
    // Store calls still running get a moment to end, not as long as they take (18 s seen in a
    // rolling restart, past the 10 s its nodes wait for it): what they leave undone is left as a
    // crash leaves it, which the store and the nodes are made for.
    // The store's close (its writer's last batch, the database's connections) is bounded the
    // same way: 5.8 s seen after the runtime was down, in a 30 000-node rolling restart.
    let closing = std::time::Instant::now();
    runtime.shutdown_timeout(EXIT_PATIENCE);
    let runtime_ms = closing.elapsed().as_millis() as u64;
    let (closed, store_closed) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let last = Arc::strong_count(&coordinator) == 1;
        drop(coordinator);
        let _ = closed.send(last);
    });
    let store_closed = store_closed.recv_timeout(EXIT_PATIENCE).unwrap_or(false);
    tracing::info!(
        runtime_ms,
        closing_ms = closing.elapsed().as_millis() as u64,
        store_closed,
        "exiting"
    );
    served
}

/// The diagnostic listener `--metrics-listen` asks for (none for `off`), checked before serving.
async fn bind_metrics(
    listen: &str,
    auth: Option<&Path>,
) -> Result<Option<metrics::MetricsListener>> {
    let auth = auth.map(metrics::BearerToken::from_file).transpose()?;
    if listen == "off" {
        return Ok(None);
    }
    Ok(Some(metrics::MetricsListener::bind(listen, auth).await?))
}

/// The threads `serve` lends to blocking work: the store's calls (a pool's worth at a time)
/// and the file steps of content sends. Tokio's default is 512, and each thread it starts stays
/// while any work comes within its keep-alive, holding its stack and its allocator cache: in a
/// 30 000-node rolling restart a coordinator grew to 237 of them while the runs held back were
/// dispatched, and its RSS with them (BENCHMARKS.md, run 38).
const SERVE_BLOCKING_THREADS: usize = 64;

/// Files this process may open, less a reserve for its store, blobs and logs: one a connection.
fn default_max_connections() -> usize {
    /// Open files kept for what is not a connection.
    const RESERVE: u64 = 256;
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    let open_files = limit.current.unwrap_or(1 << 20);
    open_files.saturating_sub(RESERVE).max(1) as usize
}

/// One join file for `request`.
fn mint(place: &Place, request: TokenRequest) -> Result<JoinFile> {
    match operate(place, operator::Request::Token(request))? {
        operator::Answer::Token(join) => Ok(*join),
        _ => Err(mismatch("token")),
    }
}

/// A serving coordinator answered a request with another request's answer: another version.
fn mismatch(command: &str) -> anyhow::Error {
    anyhow::anyhow!(
        "the serving coordinator answered `{command}` with another kind of answer: run the CLI of the serving coordinator's version"
    )
}

fn release(place: &Place, command: cli::ReleaseCmd) -> Result<()> {
    use fleet_coordinator::release;
    match command {
        cli::ReleaseCmd::Trust { root } => {
            let operator::Answer::Roots(roots) =
                operate(place, operator::Request::TrustRoot { root })?
            else {
                return Err(mismatch("release trust"));
            };
            for root in roots {
                println!("{root}");
            }
        }
        cli::ReleaseCmd::Revoke { key } => {
            let operator::Answer::Trust(trust) =
                operate(place, operator::Request::RevokeReleaseKey { key })?
            else {
                return Err(mismatch("release revoke"));
            };
            for key in trust.revoked {
                println!("revoked {key}");
            }
        }
        cli::ReleaseCmd::Add { dir } => {
            let progress = fleet_coordinator::progress::Progress::on_terminal();
            let offered = release::offer(&dir, &coordinator::blobs(&place.data), &progress)?;
            let spinner = progress.spinner(
                "checking the release and copying its binaries to the fleet's coordinators",
            );
            let answer = operate(place, operator::Request::AddRelease(offered));
            spinner.finish_and_clear();
            let operator::Answer::Release(taken) = answer? else {
                return Err(mismatch("release add"));
            };
            let m = &taken.manifest;
            let what = if taken.new { "took in" } else { "already had" };
            println!(
                "{what} release {} (sequence {}, {} binaries)",
                m.version,
                m.sequence,
                m.binaries.len()
            );
        }
        cli::ReleaseCmd::List { json } => {
            let operator::Answer::Releases(releases) = operate(place, operator::Request::Releases)?
            else {
                return Err(mismatch("release list"));
            };
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
        cli::ReleaseCmd::Keygen { out } => println!("{}", release::keygen(&out)?),
        cli::ReleaseCmd::Certify {
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
        cli::ReleaseCmd::Sign(s) => {
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
        cli::ReleaseCmd::Verify { dir, roots } => {
            let manifest = release::verify_dir(&dir, &roots, fleet_proto::clock::now_ms())?;
            println!("{}", serde_json::to_string_pretty(&manifest)?);
        }
    }
    Ok(())
}

/// The state of a node's last update, in one word for the `nodes` table (`--json` has it whole).
fn update_word(outcome: &fleet_proto::release::UpdateOutcome) -> &'static str {
    use fleet_proto::release::UpdateOutcome;
    match outcome {
        UpdateOutcome::Trial { .. } => "trial",
        UpdateOutcome::Kept { .. } => "kept",
        UpdateOutcome::Reverted { .. } => "reverted",
        UpdateOutcome::Refused { .. } => "refused",
    }
}

fn rollout(place: &Place, command: cli::RolloutCmd) -> Result<()> {
    use fleet_coordinator::rollout::{RolloutPlan, RolloutState};
    let (request, json) = match command {
        cli::RolloutCmd::Start(s) => {
            let plan = RolloutPlan {
                release: s.release,
                canaries: s.canaries,
                waves: s.waves.0,
                wait_ms: s.wait.as_millis() as u64,
                halt_at: s.halt_at,
                selector: s.selector,
            };
            (operator::Request::StartRollout(plan), false)
        }
        cli::RolloutCmd::Status { watch: true, .. } => return watch_rollout(place),
        cli::RolloutCmd::Status { json, .. } => (operator::Request::Rollout, json),
        cli::RolloutCmd::Pause => (operator::Request::SetRollout(RolloutState::Paused), false),
        cli::RolloutCmd::Resume => (operator::Request::SetRollout(RolloutState::Running), false),
        cli::RolloutCmd::Abort => (operator::Request::SetRollout(RolloutState::Aborted), false),
    };
    let operator::Answer::Rollout(rollout) = operate(place, request)? else {
        return Err(mismatch("rollout"));
    };
    let Some(rollout) = rollout else {
        anyhow::bail!("no rollout was started: see `fleet-coordinator rollout start --help`");
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
    use fleet_coordinator::rollout::RolloutState;
    let progress = fleet_coordinator::progress::Progress::on_terminal();
    let bar = progress.machines(0);
    let mut said = String::new();
    loop {
        let operator::Answer::Rollout(rollout) = operate(place, operator::Request::Rollout)? else {
            return Err(mismatch("rollout status"));
        };
        let Some(rollout) = rollout else {
            anyhow::bail!("no rollout was started: see `fleet-coordinator rollout start --help`");
        };
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
