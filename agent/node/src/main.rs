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
    // The watchdog of an update, started by the agent itself from the old release's binary.
    if std::env::args_os()
        .nth(1)
        .is_some_and(|a| a == "watch-update")
    {
        let args = WatchCli::parse_from(std::env::args_os().skip(1));
        binary::run("fleet-agent watch-update", args.log_format, || {
            Ok(fleet_agent::update::watch(&args.watch)?)
        });
        return;
    }
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
            gpus: fleet_agent::gpus::GpuSources {
                nvidia_tool: args.accelerator_tool,
                rocm_tool: args.rocm_tool,
                sysfs: args.sysfs_root,
            },
            link: Default::default(),
            max_runs: args.max_runs,
            releases: None,
        },
        install_dir: args.install_dir,
        update_trial: args.update_trial,
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

/// `fleet-agent watch-update ...`: not for people; the agent starts it for each update.
#[derive(Parser)]
#[command(name = "watch-update")]
struct WatchCli {
    #[arg(long, value_enum, default_value = "human")]
    log_format: fleet_cli::logging::LogFormat,
    #[command(flatten)]
    watch: fleet_agent::update::WatchArgs,
}
