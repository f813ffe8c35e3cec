//! The `oci` command line.
mod artifact_cli;
mod build_cli;
mod remote_cli;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "oci",
    about = "Reproducible OCI images from a folder; inspect, push and copy by digest"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Build a reproducible image from a folder into a layout; prints the manifest digest
    Build(build_cli::BuildArgs),
    /// Write an image index over per-platform images of a layout; prints the index digest
    Index(build_cli::IndexArgs),
    /// Push an image from a layout to a registry; prints the manifest digest
    Push(remote_cli::PushArgs),
    /// Copy an image between registries and layouts, by digest; prints the manifest digest
    Copy(remote_cli::CopyArgs),
    /// List what refers to an image (signatures, SBOMs, attestations)
    Referrers(artifact_cli::ReferrersArgs),
    /// Attach a file to an image as an artifact that refers to it; prints the artifact's digest
    Attach(artifact_cli::AttachArgs),
    /// Sign an image in cosign's format with an ECDSA P-256 key; prints the signatures' digest
    Sign(artifact_cli::SignArgs),
    /// Check that an image carries a valid cosign-format signature by one of the keys
    Verify(artifact_cli::VerifyArgs),
    /// Show an image: oci:DIR:REF, oci:DIR@sha256:HEX or docker://HOST/REPO[:TAG|@sha256:HEX]
    Inspect {
        /// The image
        reference: String,
        #[command(flatten)]
        remote: remote_cli::RemoteInspectArgs,
    },
}

fn main() {
    // Before any thread starts: an interrupt removes this command's temporary files.
    oci::local::cleanup::install();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if e.use_stderr() => {
            eprintln!("oci: {}", usage_line(&e));
            std::process::exit(2);
        }
        Err(e) => e.exit(),
    };
    let result = match cli.command {
        Command::Push(args) => remote_cli::push(args),
        Command::Copy(args) => remote_cli::copy(args),
        Command::Referrers(args) => artifact_cli::referrers(args),
        Command::Attach(args) => artifact_cli::attach(args),
        Command::Sign(args) => artifact_cli::sign(args),
        Command::Verify(args) => artifact_cli::verify(args),
        Command::Build(args) => build_cli::build(args),
        Command::Index(args) => build_cli::index(args),
        Command::Inspect { reference, remote } if !remote_cli::is_remote(&reference) => {
            build_cli::inspect(&reference, remote.json, remote.raw)
        }
        Command::Inspect { reference, remote } => remote_cli::inspect(&reference, &remote),
    };
    if let Err(err) = result {
        eprintln!("oci: {}", one_line(&err));
        std::process::exit(1);
    }
}

/// The error and its causes on one line, skipping a cause the message above already quotes.
fn one_line(err: &anyhow::Error) -> String {
    let mut line = err.to_string();
    for cause in err.chain().skip(1) {
        let text = cause.to_string();
        if !line.contains(&text) {
            line = format!("{line}: {text}");
        }
    }
    line
}

/// A command-line error as one line: clap's message up to its usage block, newlines folded.
fn usage_line(e: &clap::Error) -> String {
    let text = e.to_string();
    let message = text.split("\n\n").next().unwrap_or("");
    let message = message.trim_start_matches("error: ");
    let folded: Vec<&str> = message.split_whitespace().collect();
    format!("{}; see oci --help", folded.join(" "))
}
