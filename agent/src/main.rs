//! The `fleet-agent` binary: the machine's agent by default, `coordinator ...` for the hub side.
mod cli;

use anyhow::{Context, Result};
use base64::Engine;
use clap::Parser;
use cli::{
    AgentArgs, Cli, Command, CoordinatorArgs, CoordinatorCommand, NodesArgs, RunArgs, ServeArgs,
    StatusArgs, TokenArgs,
};
use fleet_agent::coordinator::runs::{RunRequest, RunView};
use fleet_agent::coordinator::store::is_final;
use fleet_agent::coordinator::{
    self, Coordinator, NodeView, TokenRequest, operator, serve, userdata,
};
use fleet_agent::facts::FactsSource;
use fleet_agent::protocol::RunOptions;
use fleet_agent::session::SessionSettings;
use fleet_agent::{agent, logging};
use std::sync::Arc;

fn main() {
    let cli = Cli::parse();
    let log_format = cli.log_format;
    logging::init(log_format);
    let result = match cli.command {
        None => run_agent(cli.agent),
        Some(Command::Coordinator(args)) => run_coordinator(args),
    };
    if let Err(err) = result {
        // A JSON log carries the fatal line too, for collectors; a human reads it once on stderr.
        if matches!(log_format, logging::LogFormat::Json) {
            tracing::error!("{err:#}");
        }
        eprintln!("fleet-agent: {err:#}");
        std::process::exit(1);
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    // One thread keeps the agent's memory small; the work is I/O bound.
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

fn run_agent(args: AgentArgs) -> Result<()> {
    let config = agent::AgentConfig {
        join_file: args.join_file,
        state: args.state,
        cloud_root: args.cloud_root,
        facts: FactsSource {
            run_store: args.run_store,
            accelerator_tool: args.accelerator_tool,
        },
        session: SessionSettings {
            validity: args.session_validity,
            retry_base: args.retry_base,
        },
        supervisor: args.supervisor,
    };
    runtime()?.block_on(async {
        tokio::select! {
            result = agent::run(config) => match result {
                Ok(never) => match never {},
                Err(e) => Err(e.into()),
            },
            _ = stop_signal() => {
                tracing::info!("stopping on a signal");
                Ok(())
            }
        }
    })
}

async fn stop_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("can watch SIGTERM");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

fn run_coordinator(args: CoordinatorArgs) -> Result<()> {
    let data = args.data;
    match args.command {
        CoordinatorCommand::Token(t) => {
            let join = operate(&data, operator::Request::Token(token_request(&t)))?;
            println!("{}", serde_json::to_string_pretty(&join)?);
        }
        CoordinatorCommand::UserData(u) => {
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
            let join = operate(&data, operator::Request::Token(request))?;
            let join: fleet_agent::joinfile::JoinFile = serde_json::from_value(join)?;
            print!("{}", userdata::render(&join, &u.arch));
        }
        CoordinatorCommand::Nodes(n) => print_nodes(&n, operate(&data, operator::Request::Nodes)?)?,
        CoordinatorCommand::Serve(s) => serve_coordinator(&data, s)?,
        CoordinatorCommand::Run(r) => {
            let set = operate(&data, operator::Request::Run(run_request(&r)?))?;
            println!("{}", set["set_id"].as_str().unwrap_or_default());
        }
        CoordinatorCommand::Status(s) => print_status(&data, &s)?,
        CoordinatorCommand::Collect(c) => {
            let request = operator::Request::Collect {
                run: c.run.clone(),
                path: c.path.clone(),
            };
            let answer = operate(&data, request)?;
            let digest = save_collected(&answer, &c.out)?;
            println!("{digest}");
        }
        CoordinatorCommand::Stop(s) => {
            operate(&data, operator::Request::Stop { run: s.run.clone() })?;
            println!("stopped {}", s.run);
        }
    }
    Ok(())
}

fn run_request(r: &RunArgs) -> Result<RunRequest> {
    let read = |path: &std::path::Path| {
        std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))
    };
    let b64 = |bytes: Vec<u8>| base64::engine::general_purpose::STANDARD.encode(bytes);
    let mut inputs = Vec::new();
    for (name, file) in &r.inputs {
        inputs.push((name.clone(), b64(read(std::path::Path::new(file))?)));
    }
    Ok(RunRequest {
        node: r.node.clone(),
        all: r.all,
        program_b64: b64(read(&r.program)?),
        options: RunOptions {
            argv: r.args.clone(),
            timeout_ms: r.timeout.map(|t| t.as_millis() as u64),
            output_limit: r.output_limit,
            env: r.env.clone(),
            inputs,
        },
        repeat: r.repeat,
        raw_command: r.raw_command.clone(),
    })
}

fn print_status(data: &std::path::Path, s: &StatusArgs) -> Result<()> {
    let request = operator::Request::Status {
        set: s.set.clone(),
        run: s.run.clone(),
    };
    let rows: Vec<RunView> = loop {
        let rows: Vec<RunView> = serde_json::from_value(operate(data, request.clone())?)?;
        if !s.poll || rows.iter().all(|r| is_final(&r.state)) {
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
        let exit = match (r.exit_code, r.timed_out, r.stopped) {
            (_, true, _) => "timed out".to_string(),
            (_, _, true) => "stopped".to_string(),
            (Some(code), _, _) => code.to_string(),
            _ => "-".to_string(),
        };
        println!(
            "{:<16} {:<20} {:<9} {:<10} {}",
            r.run_id,
            r.node_id,
            r.state,
            exit,
            r.error.as_deref().unwrap_or("")
        );
    }
    Ok(())
}

/// Writes a collected file atomically after checking its bytes against the node's digest.
fn save_collected(answer: &serde_json::Value, out: &std::path::Path) -> Result<String> {
    use sha2::Digest;
    let digest = answer["digest"].as_str().unwrap_or_default().to_string();
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(answer["content_b64"].as_str().unwrap_or_default())
        .context("the node sent a collected file that is not base64")?;
    let got = format!("sha256:{}", hex::encode(sha2::Sha256::digest(&bytes)));
    if got != digest {
        anyhow::bail!(
            "the collected file hashes to {got}, but the node reported {digest}; collect it again"
        );
    }
    fleet_agent::fsutil::write_atomic(out, &bytes, 0o644)
        .with_context(|| format!("cannot write {}", out.display()))?;
    Ok(digest)
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

/// Through the serving coordinator's socket when it runs, else on the store directly.
fn operate(data: &std::path::Path, request: operator::Request) -> Result<serde_json::Value> {
    let response = match operator::call(data, &request) {
        Some(answer) => answer.context("the serving coordinator did not answer on its socket")?,
        None => {
            let coordinator = Coordinator::open(data)?;
            runtime()?.block_on(operator::handle(&coordinator, None, request))
        }
    };
    match response {
        operator::Response::Ok(v) => Ok(v),
        operator::Response::Error(e) => Err(anyhow::anyhow!(e)),
    }
}

fn print_nodes(args: &NodesArgs, nodes: serde_json::Value) -> Result<()> {
    if args.json {
        println!("{}", serde_json::to_string_pretty(&nodes)?);
        return Ok(());
    }
    let nodes: Vec<NodeView> = serde_json::from_value(nodes)?;
    println!(
        "{:<20} {:<7} {:<16} {:<8} {:>4} {:>4} {:<14} PUBLIC KEY",
        "ID", "STATE", "NAME", "ARCH", "CPUS", "GPUS", "HEARTBEAT"
    );
    let now = fleet_agent::fsutil::now_ms();
    for n in nodes {
        let facts = n.facts.as_ref();
        let beat = n.last_heartbeat_ms.map_or("never".to_string(), |t| {
            format!("{} s ago", now.saturating_sub(t) / 1000)
        });
        println!(
            "{:<20} {:<7} {:<16} {:<8} {:>4} {:>4} {:<14} {}",
            n.id,
            n.state,
            n.name.as_deref().unwrap_or("-"),
            facts.map_or("-", |f| f.arch.as_str()),
            facts.map_or(0, |f| f.cpus),
            facts.map_or(0, |f| f.accelerators.len()),
            beat,
            n.public_key
        );
    }
    Ok(())
}

fn serve_coordinator(data: &std::path::Path, args: ServeArgs) -> Result<()> {
    let coordinator = Arc::new(Coordinator::open(data)?);
    let config = serve::ServeConfig {
        bundles: args.bundles.unwrap_or_else(|| data.join("bundles")),
        heartbeat: args.heartbeat,
        lease: args.lease,
        max_session_validity: args.max_session_validity,
        waiting_timeout: args.waiting_timeout,
    };
    runtime()?.block_on(async {
        let listener = tokio::net::TcpListener::bind(&args.listen)
            .await
            .with_context(|| format!("cannot listen on {}", args.listen))?;
        let local = listener.local_addr()?.to_string();
        let advertise = args.advertise.unwrap_or_else(|| local.clone());
        tracing::info!(listen = %local, key = %coordinator.public_key_text(), data = %data.display(), "coordinator serving");
        let socket = operator::bind(data).context("cannot open the operator socket")?;
        let socket = tokio::spawn(operator::listen(socket, coordinator.clone(), Some(advertise)));
        println!("listening on {local}");
        let served = serve::serve(coordinator.clone(), listener, config, stop_signal()).await;
        socket.abort();
        let _ = std::fs::remove_file(operator::socket_path(data));
        served.context("the coordinator stopped")
    })
}
