//! The `fleet-coordinator` command line: argument structs with their help, apart from the handlers.
use clap::{Args, Parser, Subcommand};
use fleet_cli::duration;
use fleet_cli::logging::LogFormat;
use fleet_coordinator as coordinator;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Parser)]
#[command(
    name = "fleet-coordinator",
    version,
    about = "The coordinator of a fleet of rented machines: tokens, user data, serving, runs"
)]
pub struct Cli {
    /// The coordinator's data folder: key and store
    #[arg(long, default_value = coordinator::DEFAULT_DATA, global = true)]
    pub data: PathBuf,
    /// Keep the records in this PostgreSQL database (postgres://USER[:PASSWORD]@HOST[:PORT]/DB)
    /// instead of the embedded store in the data folder; the key stays in the data folder
    #[arg(long, global = true, value_name = "URL")]
    pub store: Option<String>,
    /// Log as human-readable lines or as one JSON object per line
    #[arg(long, value_enum, default_value = "human", global = true)]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Mint a one-time token and print its join file (JSON); with --count, one per line
    Token(TokenCmd),
    /// Mint a token and print #cloud-config user data that joins a new machine by itself
    UserData(UserDataArgs),
    /// Answer joins, sessions and bundle downloads on one port
    Serve(ServeArgs),
    /// List the nodes: id, state, name, key, facts, last heartbeat, runs out
    Nodes(NodesArgs),
    /// Run a program or an image on one node or all of them; prints the set id
    Run(RunArgs),
    /// Show a set's rows or one run's
    Status(StatusArgs),
    /// Copy a file from a run's folder; prints its sha256:HEX
    Collect(CollectArgs),
    /// Stop a run on its node (needs `serve`); returns once the run ended
    Stop(StopArgs),
    /// Replicate an artifact by digest into a node's --artifact-root through a read minted for
    /// that one fetch (needs `serve`); prints the copy as JSON
    Replicate(ReplicateArgs),
    /// Show or set the fleet's signing policy: which keys must have signed an image it runs
    Policy(PolicyArgs),
    /// Drain a node: it takes no new run and finishes what it holds (`Draining`, then
    /// `Drained`); with --undrain it takes runs again
    Drain(DrainArgs),
    /// Set or remove a node's labels, which `run --where label.KEY=VALUE` selects by
    Label(LabelArgs),
    /// Set how many runs a node takes at once; runs past it wait, in order, for one to end
    Capacity(CapacityArgs),
    /// Take a node out of the fleet: its key is refused and its agent removes its state and its
    /// unit and stops (refused while it holds runs, unless --discard)
    Retire(RetireArgs),
    /// Refuse a node's key at once on every coordinator (a stolen or compromised machine): its
    /// session is cut, the runs it holds end lost, and its agent stops
    Revoke(NodeArgs),
    /// Remove the record of a retired, revoked or lost node
    Forget(NodeArgs),
    /// Signed releases of the machines' binaries: keys, certificates, signing and checking
    #[command(subcommand)]
    Release(ReleaseCmd),
    /// Roll a release out across the fleet in stages that halt by themselves (needs `serve`)
    #[command(subcommand)]
    Rollout(RolloutCmd),
    /// Have one node take a release (the newest taken in unless --release): it checks it,
    /// installs it and restarts into it on trial; `nodes` shows how that went (needs `serve`)
    Update(UpdateArgs),
    /// Run the acceptance checks on nodes: their session, registry, store, clock, disk and
    /// engine, one row per node and check; exits 1 when any fails (needs `serve`)
    Check(CheckArgs),
}

#[derive(Args)]
pub struct CheckArgs {
    /// The node, by id or name
    #[arg(long, required_unless_present = "all", conflicts_with = "all")]
    pub node: Option<String>,
    /// Every node not retired or revoked
    #[arg(long)]
    pub all: bool,
    /// An image whose manifest each node's engine must read from its registry, as a pull
    /// would (HOST/REPO:TAG or HOST/REPO@sha256:HEX); without it the registry is not checked
    #[arg(long, value_name = "REF")]
    pub registry: Option<String>,
    /// The least free disk under each node's run store that passes
    #[arg(long, default_value = "1GiB", value_parser = parse_bytes)]
    pub min_disk: u64,
    /// Print JSON instead of a table
    #[arg(long)]
    pub json: bool,
}

#[derive(Subcommand)]
pub enum RolloutCmd {
    /// Start rolling out a release: canaries, then each wave once the one before is healthy
    Start(RolloutStartArgs),
    /// Show the rollout: its state, its stage, and each stage's machines
    Status {
        #[arg(long)]
        json: bool,
        /// Follow it until it is done (exit 0), halted or aborted (exit 1, saying why): a bar on
        /// a terminal, otherwise a line each time it changes
        #[arg(long, conflicts_with = "json")]
        watch: bool,
    },
    /// Send the release to no more machines until resumed
    Pause,
    /// Go on with a paused or halted rollout
    Resume,
    /// Stop the rollout for good; machines keep what they run
    Abort,
}

#[derive(Args)]
pub struct RolloutStartArgs {
    /// The release's sequence
    #[arg(long)]
    pub release: u64,
    /// How many machines take it first
    #[arg(long, default_value_t = 5)]
    pub canaries: u32,
    /// The shares of the eligible machines that have it after each wave, growing to 100%
    #[arg(long, default_value = "1%,10%,50%,100%", value_parser = percents)]
    pub waves: PercentList,
    /// How long each stage must be healthy before the next one starts
    #[arg(long, default_value = "10m", value_parser = duration::parse)]
    pub wait: Duration,
    /// Halt when more than this share of a stage's machines failed (reverted or refused)
    #[arg(long, default_value = "5%", value_parser = percent)]
    pub halt_at: u32,
    /// Only the machines whose facts and labels match, as `run --where` reads them
    #[arg(long = "where")]
    pub selector: Option<String>,
}

/// `--waves`: percentages, comma-separated.
#[derive(Debug, Clone)]
pub struct PercentList(pub Vec<u32>);

fn percent(text: &str) -> Result<u32, String> {
    let number = text.trim().trim_end_matches('%');
    match number.parse::<u32>() {
        Ok(p) if p <= 100 => Ok(p),
        _ => Err(format!("`{text}` is not a percentage from 0% to 100%")),
    }
}

fn percents(text: &str) -> Result<PercentList, String> {
    text.split(',')
        .map(percent)
        .collect::<Result<_, _>>()
        .map(PercentList)
}

#[derive(Args)]
pub struct UpdateArgs {
    /// The node, by id or name
    #[arg(long)]
    pub node: String,
    /// The release's sequence
    #[arg(long)]
    pub release: Option<u64>,
}

#[derive(Subcommand)]
pub enum ReleaseCmd {
    /// Make a signing key (a fleet root, or a release key) at --out; prints its public key
    Keygen {
        /// Where to write the key (PKCS#8 PEM, mode 0600); never over an existing file
        #[arg(long)]
        out: PathBuf,
    },
    /// As a fleet root, certify a release key: writes the certificate to --out
    Certify {
        /// The root's key file
        #[arg(long)]
        root: PathBuf,
        /// The release key's public key (ed25519:BASE64), as `keygen` printed it
        #[arg(long, value_parser = fleet_proto::pin::PinnedKey::parse)]
        key: fleet_proto::pin::PinnedKey,
        /// A name for people, kept in the certificate
        #[arg(long, default_value = "release")]
        name: String,
        #[arg(long)]
        out: PathBuf,
    },
    /// Sign the release in --dir (its hub-linux-x86_64.tar.gz and hub-linux-arm64.tar.gz):
    /// writes release.json, the manifest of every binary in them, and release.sig
    Sign(ReleaseSignArgs),
    /// Trust a root key: releases certified by it may be taken in (every coordinator of the
    /// fleet reads it from the store)
    Trust {
        /// The root's public key (ed25519:BASE64), as `keygen` printed it
        #[arg(long, value_parser = fleet_proto::pin::PinnedKey::parse)]
        root: fleet_proto::pin::PinnedKey,
    },
    /// Revoke a release key: no release it signed is taken in or sent from now on, a rollout of
    /// one halts, and machines learn it from the next release that names it (`sign --revoke`)
    Revoke {
        /// The release key's public key (ed25519:BASE64)
        #[arg(long, value_parser = fleet_proto::pin::PinnedKey::parse)]
        key: fleet_proto::pin::PinnedKey,
    },
    /// Take in the signed release in DIR: its signature is checked under the fleet's roots and
    /// its binaries become content by digest on enough coordinators of the fleet
    Add { dir: PathBuf },
    /// List the releases taken in, oldest first
    List {
        #[arg(long)]
        json: bool,
    },
    /// Check the release in --dir as an agent does: signatures under the roots, expiry, and
    /// every binary against the manifest; prints the manifest
    Verify {
        #[arg(long)]
        dir: PathBuf,
        /// A root public key of the fleet (ed25519:BASE64); repeat for several
        #[arg(long = "root", required = true, value_parser = fleet_proto::pin::PinnedKey::parse)]
        roots: Vec<fleet_proto::pin::PinnedKey>,
    },
}

#[derive(Args)]
pub struct ReleaseSignArgs {
    /// The release key's file
    #[arg(long)]
    pub key: PathBuf,
    /// The release key's certificate (from `release certify`)
    #[arg(long)]
    pub cert: PathBuf,
    #[arg(long)]
    pub dir: PathBuf,
    /// The release's version, for people
    #[arg(long, default_value = env!("CARGO_PKG_VERSION"))]
    pub version: String,
    /// Above every earlier release's: a machine never takes a release at or below what it runs
    #[arg(long)]
    pub sequence: u64,
    /// The lowest sequence a machine that takes this release may ever go back to
    #[arg(long)]
    pub min_sequence: Option<u64>,
    /// How long the signature holds (a stale release cannot be replayed after it)
    #[arg(long, default_value = "90d", value_parser = duration::parse)]
    pub expires_in: Duration,
    /// Rotate the fleet's roots: from this release on, machines and coordinators trust these
    /// roots (ed25519:BASE64; repeat for several) in place of the ones they trust now
    #[arg(long = "rotate-root", value_parser = fleet_proto::pin::PinnedKey::parse)]
    pub rotate_roots: Vec<fleet_proto::pin::PinnedKey>,
    /// A release key machines must never trust again (repeat for several)
    #[arg(long = "revoke", value_parser = fleet_proto::pin::PinnedKey::parse)]
    pub revoke: Vec<fleet_proto::pin::PinnedKey>,
}

#[derive(Args)]
pub struct NodeArgs {
    /// The node, by id or name
    #[arg(long)]
    pub node: String,
}

#[derive(Args)]
pub struct RetireArgs {
    /// The node, by id or name
    #[arg(long)]
    pub node: String,
    /// End the runs it holds as lost (reason `retired`) instead of refusing
    #[arg(long)]
    pub discard: bool,
}

#[derive(Args)]
#[command(group(clap::ArgGroup::new("limit").required(true).args(["runs", "reset"])))]
pub struct CapacityArgs {
    /// The node, by id or name
    #[arg(long)]
    pub node: String,
    /// Runs at once (at least 1; the agent's own --max-runs still applies when lower)
    #[arg(long, value_name = "K")]
    pub runs: Option<u32>,
    /// Lift the operator's limit: as many runs as the agent allows
    #[arg(long)]
    pub reset: bool,
}

#[derive(Args)]
pub struct LabelArgs {
    /// The node, by id or name
    #[arg(long)]
    pub node: String,
    /// Remove this label (repeatable)
    #[arg(long, value_name = "KEY")]
    pub remove: Vec<String>,
    /// Labels to set, KEY=VALUE
    #[arg(value_parser = parse_label)]
    pub labels: Vec<(String, String)>,
}

#[derive(Args)]
pub struct DrainArgs {
    /// The node, by id or name
    #[arg(long)]
    pub node: String,
    /// Take the node back: it takes new runs again
    #[arg(long)]
    pub undrain: bool,
}

#[derive(Args)]
pub struct PolicyArgs {
    /// Run only images signed (cosign's format) by one of these ECDSA P-256 public keys, PEM
    /// (repeatable; replaces the keys set before)
    #[arg(long, value_name = "PUB", conflicts_with = "clear")]
    pub require_signature: Vec<PathBuf>,
    /// Require no signature any more
    #[arg(long)]
    pub clear: bool,
}

#[derive(Args)]
pub struct ReplicateArgs {
    /// A node id or name
    #[arg(long)]
    pub node: String,
    /// The artifact's digest, sha256:HEX (taken from --file when given)
    #[arg(long)]
    pub digest: Option<String>,
    /// The artifact, streamed into the blob store and read by the node with a one-time ticket
    #[arg(long, conflicts_with = "url")]
    pub file: Option<PathBuf>,
    /// An external http(s):// URL to read it from (an object store's presigned URL)
    #[arg(long, requires = "expires_in")]
    pub url: Option<String>,
    /// How long the URL may be used, from when the node takes the command up
    #[arg(long, value_parser = duration::parse)]
    pub expires_in: Option<Duration>,
}

#[derive(Args)]
pub struct RunArgs {
    /// The node's id or name
    #[arg(long, required_unless_present_any = ["all", "where_"], conflicts_with_all = ["all", "where_"])]
    pub node: Option<String>,
    /// Every node (with --where, every node that matches)
    #[arg(long)]
    pub all: bool,
    /// Only nodes whose facts and labels match, such as arch=arm64,gpus>=1,link>=100MB/s
    /// (keys: arch, os, kernel, version, name, cpus, gpus, gpu.vendor, gpu.arch, memory, disk,
    /// link, link_confidence, assumed_link, assumed_link_confidence, cap, label.KEY)
    #[arg(long = "where", value_name = "EXPR")]
    pub where_: Option<String>,
    /// With --where: how many matching nodes, least loaded first (default 1)
    #[arg(long, requires = "where_", conflicts_with = "all", value_parser = clap::value_parser!(u32).range(1..))]
    pub count: Option<u32>,
    /// With --where: order the matching nodes by `link` (the fastest first) or `content` (those
    /// already holding the program or image first), then least loaded
    #[arg(long, requires = "where_", value_name = "link|content")]
    pub prefer: Option<String>,
    /// With --where: when no node matches now, queue the runs for a match (until the waiting
    /// timeout) rather than refuse
    #[arg(long, requires = "where_", conflicts_with = "all")]
    pub wait_for_match: bool,
    /// With --where: a run lost because its machine went away (lease expired, retired with
    /// --discard, revoked, forgotten) is placed again on another matching node, up to N times;
    /// each attempt is its own row. An attempt runs at most once; a lost one may have run partly
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub retry_lost: u32,
    /// The program file to stage and run
    #[arg(long, required_unless_present = "image", conflicts_with = "image")]
    pub program: Option<PathBuf>,
    /// An image to run on the node's Docker engine, by digest: HOST/REPO@sha256:HEX
    #[arg(long)]
    pub image: Option<String>,
    /// The registry credential for --image: a JSON file {"username": ..., "password": ...};
    /// sent only in the node's start command, never stored
    #[arg(long, requires = "image")]
    pub registry_auth: Option<PathBuf>,
    /// Stop the run after this long
    #[arg(long, value_parser = duration::parse)]
    pub timeout: Option<Duration>,
    /// Bytes kept per output stream
    #[arg(long)]
    pub output_limit: Option<u64>,
    /// An input file, NAME=FILE (repeatable)
    #[arg(long = "input", value_parser = parse_label)]
    pub inputs: Vec<(String, String)>,
    /// An environment variable, NAME=VALUE (repeatable)
    #[arg(long = "env", value_parser = parse_label)]
    pub env: Vec<(String, String)>,
    /// Runs per node in this set
    #[arg(long, default_value_t = 1)]
    pub repeat: u32,
    /// For protocol-skew testing: sends this command object (JSON) as-is in place of the start.
    /// A test build's only (debug assertions): a release refuses the flag.
    #[cfg(debug_assertions)]
    #[arg(long, hide = true, value_parser = parse_json_object)]
    pub raw_command: Option<serde_json::Value>,
    /// The program's arguments, passed on byte for byte
    #[arg(last = true, value_parser = clap::value_parser!(std::ffi::OsString))]
    pub args: Vec<std::ffi::OsString>,
}

#[derive(Args)]
pub struct StatusArgs {
    #[arg(long, required_unless_present = "run", conflicts_with = "run")]
    pub set: Option<String>,
    #[arg(long)]
    pub run: Option<String>,
    /// Print JSON instead of a table
    #[arg(long)]
    pub json: bool,
    /// Wait until every row is final
    #[arg(long)]
    pub poll: bool,
}

#[derive(Args)]
pub struct CollectArgs {
    #[arg(long)]
    pub run: String,
    /// The file, relative to the run's folder
    #[arg(long)]
    pub path: String,
    /// Where to write it (atomically: the whole file or nothing)
    #[arg(long)]
    pub out: PathBuf,
    /// Refuse a file larger than this many bytes (nothing is written at --out)
    #[arg(long)]
    pub max_bytes: Option<u64>,
}

#[derive(Args)]
pub struct StopArgs {
    #[arg(long)]
    pub run: String,
}

#[derive(Args)]
pub struct TokenCmd {
    #[command(flatten)]
    pub token: TokenArgs,
    /// How many tokens to mint: each join file is printed on one line (JSON lines)
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub count: u32,
}

#[derive(Args, Clone)]
pub struct TokenArgs {
    /// How long the token may be used
    #[arg(long, default_value = "1h", value_parser = duration::parse)]
    pub ttl: Duration,
    /// The node's name
    #[arg(long)]
    pub name: Option<String>,
    /// A label for the node, KEY=VALUE (repeatable)
    #[arg(long = "label", value_parser = parse_label)]
    pub labels: Vec<(String, String)>,
    /// The coordinator's host:port as machines reach it (default: the serving coordinator's)
    #[arg(long)]
    pub address: Option<String>,
    /// The bundle's SHA-256 to put in the join file
    #[arg(long)]
    pub bundle_sha256: Option<String>,
}

#[derive(Args)]
pub struct UserDataArgs {
    #[command(flatten)]
    pub token: TokenArgs,
    /// The machine's architecture: which bundle it fetches
    #[arg(long, default_value = "x86_64", value_parser = ["x86_64", "arm64"])]
    pub arch: String,
    /// The folder holding hub-linux-<arch>.tar.gz (default: DATA/bundles)
    #[arg(long)]
    pub bundles: Option<PathBuf>,
}

#[derive(Args)]
pub struct ServeArgs {
    /// Where to listen for agents and bundle downloads
    #[arg(long, default_value_t = format!("0.0.0.0:{}", coordinator::DEFAULT_PORT))]
    pub listen: String,
    /// The host:port machines reach this coordinator at, for join files (default: the listen address)
    #[arg(long)]
    pub advertise: Option<String>,
    /// The folder holding hub-linux-<arch>.tar.gz (default: DATA/bundles)
    #[arg(long)]
    pub bundles: Option<PathBuf>,
    /// How often agents send heartbeats
    #[arg(long, default_value = "5s", value_parser = duration::parse)]
    pub heartbeat: Duration,
    /// How long a node stays Joined without a heartbeat
    #[arg(long, default_value = "20s", value_parser = duration::parse)]
    pub lease: Duration,
    /// The longest session certificate accepted
    #[arg(long, default_value = "1h", value_parser = duration::parse)]
    pub max_session_validity: Duration,
    /// A run no node took within this long fails
    #[arg(long, default_value = "20m", value_parser = duration::parse)]
    pub waiting_timeout: Duration,
    /// Connections served at once; past it new ones wait (default: the open-file limit less 256)
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections: Option<u32>,
    /// Content imported through this coordinator (a run's program and inputs) is held by this
    /// many coordinators of the fleet, or all when fewer serve, before `run` records the runs
    #[arg(long, default_value_t = 2, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub content_copies: u32,
    /// Nodes fetching a program from this coordinator because it sent them a stage, at most, at
    /// once: the runs of the others wait their turn, in order, so a dispatch to every node is a
    /// steady stream of fetches, not one connection each at the same moment
    #[arg(long, default_value_t = fleet_coordinator::DEFAULT_FETCH_WINDOW, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub fetch_window: u32,
    /// On shutdown, how long connections get to finish before they are cut
    #[arg(long, default_value = "10s", value_parser = duration::parse)]
    pub shutdown_grace: Duration,
    /// Where to serve /metrics (Prometheus), /healthz and /readyz, or `off`
    #[arg(long, default_value = "127.0.0.1:9464")]
    pub metrics_listen: String,
    /// A file holding the bearer token /metrics asks for (needed off loopback; mode 600)
    #[arg(long)]
    pub metrics_auth: Option<PathBuf>,
}

#[derive(Args)]
pub struct NodesArgs {
    /// Print JSON instead of a table
    #[arg(long)]
    pub json: bool,
    /// Only nodes in this state: joined, lost, failed, draining, drained, retired or revoked
    #[arg(long)]
    pub state: Option<String>,
    /// Only nodes whose facts and labels match, as `run --where` reads them
    #[arg(long = "where", value_name = "EXPR")]
    pub where_: Option<String>,
}

#[cfg(debug_assertions)]
fn parse_json_object(text: &str) -> Result<serde_json::Value, String> {
    match serde_json::from_str(text) {
        Ok(value @ serde_json::Value::Object(_)) => Ok(value),
        Ok(_) => Err("not a JSON object: pass the command as {\"kind\": ...}".into()),
        Err(e) => Err(format!(
            "not JSON ({e}): pass the command as {{\"kind\": ...}}"
        )),
    }
}

/// Bytes with an optional unit: `512MiB`, `1GiB`, `10GB`.
fn parse_bytes(text: &str) -> Result<u64, String> {
    fleet_coordinator::placement::quantity(text.trim())
        .ok_or_else(|| format!("`{text}` is not a size: write e.g. 512MiB or 1GiB"))
}

fn parse_label(text: &str) -> Result<(String, String), String> {
    text.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("`{text}` is not KEY=VALUE"))
}
