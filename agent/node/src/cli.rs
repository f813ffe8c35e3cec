//! The `fleet-agent` command line, apart from its handler.
use clap::Parser;
use fleet_agent::agent;
use fleet_agent::runtime::docker::{EngineAddress, TlsFiles};
use fleet_cli::duration;
use fleet_cli::logging::LogFormat;
use fleet_proto::joinfile;
use std::path::PathBuf;
use std::time::Duration;

/// The machine's agent: joins with its join file once, then keeps a session open.
#[derive(Parser, Clone)]
#[command(
    name = "fleet-agent",
    version,
    about = "The edge agent of a fleet of rented machines (the coordinator is fleet-coordinator)"
)]
pub struct AgentArgs {
    /// Log as human-readable lines or as one JSON object per line
    #[arg(long, value_enum, default_value = "human")]
    pub log_format: LogFormat,
    /// Accepted for the seed bootstrap's form; the agent never has a UI
    #[arg(long)]
    pub head_less: bool,
    /// The join file cloud-init wrote
    #[arg(long, default_value = joinfile::DEFAULT_PATH)]
    pub join_file: PathBuf,
    /// The node's state folder: key and membership
    #[arg(long, default_value = agent::DEFAULT_STATE)]
    pub state: PathBuf,
    /// The run store, whose free disk the facts report
    #[arg(long, default_value = "/var/lib/octomy-runs")]
    pub run_store: PathBuf,
    /// cloud-init's folder, whose copies of the user data are removed after the join
    #[arg(long, default_value = agent::DEFAULT_CLOUD_ROOT)]
    pub cloud_root: PathBuf,
    /// Where replicated artifacts go (the operator's choice of disk); without it, artifact
    /// commands are refused
    #[arg(long)]
    pub artifact_root: Option<PathBuf>,
    /// The tool that lists NVIDIA's GPUs
    #[arg(long, default_value = "nvidia-smi")]
    pub accelerator_tool: PathBuf,
    /// The tool that names AMD's GPUs, where it is installed (the kernel's files list them)
    #[arg(long, default_value = "rocm-smi")]
    pub rocm_tool: PathBuf,
    /// The root of the kernel's reports, where AMD's and Intel's GPUs are read from
    #[arg(long, default_value = "/sys")]
    pub sysfs_root: PathBuf,
    /// How many runs this machine takes at once, as it tells the coordinator (default: one per
    /// CPU); the coordinator queues the rest
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_runs: Option<u32>,
    /// How long each session certificate is valid; renewed at two thirds
    #[arg(long, default_value = "10m", value_parser = duration::parse)]
    pub session_validity: Duration,
    /// Where the agent's releases live (`releases/`, the `current` link, and `fleet-agent` and
    /// `fleet-run-supervisor` through it): what a self-update installs into
    #[arg(long, default_value = fleet_agent::agent::DEFAULT_INSTALL_DIR)]
    pub install_dir: PathBuf,
    /// How long a new release has to hold a session and pass its self-check before it is reverted
    #[arg(long, default_value = "20s", value_parser = duration::parse)]
    pub update_trial: Duration,
    /// The run supervisor (default: fleet-run-supervisor beside this executable)
    #[arg(long)]
    pub supervisor: Option<PathBuf>,
    /// The Docker engine for images: unix:///PATH, tcp://HOST:PORT or https://HOST:2376
    /// (default: $DOCKER_HOST, else the local socket)
    #[arg(long)]
    pub docker_host: Option<String>,
    /// The client certificate for a TLS engine (default: $DOCKER_CERT_PATH/cert.pem when
    /// $DOCKER_TLS_VERIFY is set)
    #[arg(long, requires_all = ["docker_tls_key", "docker_tls_ca"])]
    pub docker_tls_cert: Option<PathBuf>,
    /// The client key for a TLS engine
    #[arg(long, requires_all = ["docker_tls_cert", "docker_tls_ca"])]
    pub docker_tls_key: Option<PathBuf>,
    /// The only CA the engine's certificate is trusted through (alone: an engine that asks for
    /// no client certificate)
    #[arg(long)]
    pub docker_tls_ca: Option<PathBuf>,
    /// The first wait before a retry; it doubles up to 30 s, with jitter
    #[arg(long, default_value = "250ms", value_parser = duration::parse)]
    pub retry_base: Duration,
}

impl AgentArgs {
    /// The engine from the flags, else Docker's environment variables.
    pub fn docker(&self) -> EngineAddress {
        let env = EngineAddress::from_env();
        let tls = match &self.docker_tls_ca {
            Some(ca) => Some(TlsFiles {
                cert: self.docker_tls_cert.clone(),
                key: self.docker_tls_key.clone(),
                ca: ca.clone(),
            }),
            None => env.tls,
        };
        EngineAddress {
            host: self.docker_host.clone().or(env.host),
            tls,
        }
    }
}
