//! The `fleet-agent` binary: the machine's agent. The coordinator is `fleet-coordinator`.
mod cli;

use anyhow::Result;
use clap::Parser;
use cli::AgentArgs;
use fleet_agent::agent;
use fleet_agent::facts::FactsSource;
use fleet_agent::session::SessionSettings;
use fleet_cli::binary;

fn main() {
    let cli = AgentArgs::parse();
    binary::run("fleet-agent", cli.log_format, || run_agent(cli));
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
            link: Default::default(),
            max_runs: args.max_runs,
        },
        artifact_root: args.artifact_root,
        session: SessionSettings {
            validity: args.session_validity,
            retry_base: args.retry_base,
        },
        supervisor: args.supervisor,
        docker,
    };
    binary::async_runtime()?.block_on(async {
        tokio::select! {
            result = agent::run(config) => match result {
                Ok(never) => match never {},
                Err(agent::AgentError::Ended(ended)) => Err(binary::ExitWith {
                    status: ended.status(),
                    message: ended.to_string(),
                }
                .into()),
                Err(e) => Err(e.into()),
            },
            _ = binary::stop_signal() => {
                tracing::info!("stopping on a signal");
                Ok(())
            }
        }
    })
}
