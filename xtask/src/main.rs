//! `cargo xtask`: ci, demo, static cross builds, bundles, benchmarks, the soak and fuzzing.
mod bench;
mod ci;
mod cross;
mod demo;
mod fleet;
mod fuzz;
mod image;
mod layers;
mod soak;
mod util;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "Project tasks beyond cargo build")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install what the tests need, then run fmt, clippy and the whole test suite
    Ci {
        /// Run the suite while stress-ng keeps both cores and the disk busy, as machines in the
        /// field are
        #[arg(long)]
        busy: bool,
    },
    /// Run the main job end to end on the embedded default, on loopback
    Demo,
    /// Build static musl binaries for x86_64 and arm64 and pack hub-linux-<arch>.tar.gz bundles
    Dist {
        /// Only this architecture (x86_64 or arm64)
        #[arg(long)]
        arch: Option<String>,
        /// Sign the release with this release key (its certificate is KEY.cert beside it):
        /// writes dist/release.json and dist/release.sig
        #[arg(long, value_name = "KEY", conflicts_with = "arch")]
        sign: Option<std::path::PathBuf>,
        /// The release's sequence (default: the number of commits on HEAD, which only grows
        /// along main)
        #[arg(long, requires = "sign")]
        sequence: Option<u64>,
    },
    /// Run `dist` from two clones at different paths and check the bundles are byte-identical
    DistCheck {
        /// Only this architecture (x86_64 or arm64)
        #[arg(long)]
        arch: Option<String>,
    },
    /// Check the layers ARCHITECTURE.md's layers block declares: no import up a layer, no
    /// import cycle, the public module lists and the package order as written
    Layers {
        /// Also print each crate's imports between top-level modules
        #[arg(long)]
        graph: bool,
    },
    /// Build the agent's own multi-arch OCI image (linux/amd64, linux/arm64) into dist/image
    Image,
    /// Run a benchmark side by side with its peer and record it in BENCHMARKS.md
    Bench {
        #[command(subcommand)]
        which: bench::Which,
    },
    /// Fuzz the decoders of outside bytes with libFuzzer (nightly and cargo-fuzz are installed
    /// when missing); a crash found is kept in fuzz/regressions and fails the task
    Fuzz {
        /// Seconds of fuzzing per target
        #[arg(long, default_value_t = 60)]
        time: u64,
        /// Only this target (fuzz/fuzz_targets/TARGET.rs); every target when omitted
        target: Option<String>,
        /// Build with AddressSanitizer (slower to build and to run; the default is none)
        #[arg(long)]
        asan: bool,
        /// Arguments for libFuzzer itself, after `--` (`-fork=1 -ignore_crashes=1`, `-jobs=2`)
        #[arg(last = true)]
        libfuzzer: Vec<String>,
    },
    /// Kill the agent at random moments across many runs and check exactly-once
    Soak {
        /// How many kills
        #[arg(long, default_value_t = 1000)]
        kills: usize,
    },
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.task {
        Task::Ci { busy } => ci::run(busy),
        Task::Demo => demo::run(),
        Task::Dist {
            arch,
            sign,
            sequence,
        } => cross::dist(arch.as_deref()).and_then(|()| match sign {
            Some(key) => cross::sign(&key, sequence),
            None => Ok(()),
        }),
        Task::DistCheck { arch } => cross::check_reproducible(arch.as_deref()),
        Task::Image => image::run(),
        Task::Layers { graph } => layers::run(graph),
        Task::Bench { which } => bench::run(which),
        Task::Soak { kills } => soak::run(kills),
        Task::Fuzz {
            time,
            target,
            asan,
            libfuzzer,
        } => fuzz::run(time, target.as_deref(), asan, &libfuzzer),
    };
    if let Err(err) = result {
        eprintln!("xtask: {err:#}");
        std::process::exit(1);
    }
}
