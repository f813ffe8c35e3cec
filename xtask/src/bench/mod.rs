//! `cargo xtask bench`: each benchmark runs our tool and its peer in one run and records medians.
mod agent;
mod baseline;
mod build;
pub(crate) mod container;
mod content;
mod fleet;
mod flood;
mod postgres;
pub(crate) mod registry;
mod rollout;
mod supervisor;

use anyhow::Result;
use clap::Subcommand;

#[derive(Subcommand)]
pub enum Which {
    /// `oci build` against `umoci insert` and `tar --sort=name | sha256sum`
    Build,
    /// `oci push`/`oci copy` against `skopeo copy` and parallel curl PUTs
    Registry {
        /// Run the same pushes and copies with the `oci` built from this commit too, side by side
        #[arg(long)]
        baseline: Option<String>,
    },
    /// `fleet-run-supervisor start`+`wait` against `/bin/true` and `timeout 10 /bin/true`
    Supervisor,
    /// The agent's idle memory, time to Joined, binary size and run throughput
    Agent,
    /// An image run through the coordinator and the agent's Docker runtime against `docker run`
    Container,
    /// K coordinators and N simulated nodes: join time, memory per node, CPU per heartbeat,
    /// database commits, dispatch, and with K > 1 the failover of a killed coordinator's nodes
    Fleet {
        /// How many simulated nodes in all
        #[arg(long, default_value_t = 10_000)]
        nodes: usize,
        /// How many coordinators share the fleet (more than one needs --store postgres)
        #[arg(long, default_value_t = 1)]
        coordinators: usize,
        /// The coordinators' store
        #[arg(long, value_enum, default_value_t = fleet::StoreKind::Redb)]
        store: fleet::StoreKind,
        /// Serve with the metrics listener off (`--metrics-listen off`), to compare its cost
        #[arg(long)]
        no_metrics: bool,
        /// Ten runs to every node of capacity four instead (one coordinator): the queue for
        /// capacity, until every row is final
        #[arg(long, conflicts_with_all = ["coordinators", "no_metrics"])]
        queue: bool,
        /// Restart every coordinator in turn (SIGTERM, start again) while runs are dispatched
        /// (needs --store postgres and --coordinators 2 or more)
        #[arg(long, conflicts_with_all = ["queue", "no_metrics"])]
        rolling_restart: bool,
        /// Run the same fleet on the binaries built from this commit too (its coordinator and
        /// its load generator), side by side
        #[arg(long, conflicts_with_all = ["queue", "rolling_restart"])]
        baseline: Option<String>,
    },
    /// 1 GiB staged onto a node and collected back, against curl over HTTPS on loopback
    Content {
        /// Stage, collect and import with the binaries built from this commit too, side by side
        #[arg(long)]
        baseline: Option<String>,
    },
    /// A release rolled out to N simulated nodes through the real protocol (each fetches the
    /// binaries and reports the swap without exec'ing): time to all on it, CPU, memory, bytes
    Rollout {
        #[arg(long, default_value_t = 10_000)]
        nodes: usize,
    },
    /// Joins with wrong tokens from many source addresses against a coordinator holding
    /// sessions: its CPU, the sessions' heartbeat gaps, a good token's join meanwhile
    Flood {
        /// Connections a second
        #[arg(long, default_value_t = 10_000)]
        rate: u32,
        /// Source addresses on loopback (127.0.1.1 up)
        #[arg(long, default_value_t = 64)]
        sources: u32,
        /// How long the flood lasts
        #[arg(long, default_value_t = 30)]
        seconds: u64,
        /// Run the same flood against the coordinator built from this commit too, side by side
        /// (e.g. the commit before the failed-join limiter)
        #[arg(long)]
        baseline: Option<String>,
    },
}

pub fn run(which: Which) -> Result<()> {
    match which {
        Which::Build => build::run(),
        Which::Registry { baseline } => registry::run(baseline.as_deref()),
        Which::Supervisor => supervisor::run(),
        Which::Agent => agent::run(),
        Which::Container => container::run(),
        Which::Fleet {
            nodes,
            coordinators,
            store,
            no_metrics,
            queue,
            rolling_restart,
            baseline,
        } => match (queue, rolling_restart) {
            (true, _) => fleet::queue(nodes, store),
            (_, true) if store != fleet::StoreKind::Postgres => {
                anyhow::bail!("a rolling restart shares one store: pass --store postgres")
            }
            (_, true) => fleet::rolling_restart(nodes, coordinators),
            _ => fleet::run(nodes, coordinators, store, !no_metrics, baseline.as_deref()),
        },
        Which::Content { baseline } => content::run(baseline.as_deref()),
        Which::Rollout { nodes } => rollout::run(nodes),
        Which::Flood {
            rate,
            sources,
            seconds,
            baseline,
        } => flood::run(rate, sources, seconds, baseline.as_deref()),
    }
}
