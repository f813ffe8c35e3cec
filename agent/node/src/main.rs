//! The `fleet-agent` binary: the machine's agent. The coordinator is `fleet-coordinator`.
mod cli;

use anyhow::{Context, Result};
use clap::Parser;
use cli::AgentArgs;
use fleet_agent::agent;
use fleet_agent::facts::FactsSource;
use fleet_agent::session::SessionSettings;
use fleet_proto::logging;

fn main() {
    let cli = AgentArgs::parse();
    let log_format = cli.log_format;
    logging::init(log_format);
    let result = run_agent(cli);
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
    let docker = args.docker();
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
        docker,
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
