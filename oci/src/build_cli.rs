//! The local commands of the `oci` binary: `build`, `index` and `inspect oci:...`, their flags and output.
use anyhow::{Result, bail};
use clap::Args;
use oci::local::build::{self, BuildOptions};
use oci::local::compress::{self, Compression};
use oci::local::layout::Layout;
use oci::transfer::reference::ImageRef;
use std::io::Write;
use std::path::PathBuf;

/// `oci build` flags (the hub's `oci.build` task parameters).
#[derive(Args, Debug)]
pub struct BuildArgs {
    /// The OCI layout to write (made when missing or empty)
    #[arg(long, value_name = "DIR")]
    pub layout: PathBuf,
    /// The name to add or replace in the layout's index.json
    #[arg(long = "ref", value_name = "REF")]
    pub ref_name: String,
    /// The folder whose contents become the image's new layer
    #[arg(long, value_name = "DIR")]
    pub root: PathBuf,
    /// The image's platform [default: the base's, else linux/amd64, never the host's]
    #[arg(long, value_name = "OS/ARCH[/VARIANT]")]
    pub platform: Option<String>,
    /// Where the root's contents go in the image
    #[arg(long, value_name = "/PATH", default_value = "/")]
    pub prefix: String,
    /// The entrypoint, one flag per argument (replaces the base's entrypoint and cmd)
    #[arg(long, value_name = "ARG", allow_hyphen_values = true)]
    pub entrypoint: Vec<String>,
    /// The cmd, one flag per argument
    #[arg(long, value_name = "ARG", allow_hyphen_values = true)]
    pub cmd: Vec<String>,
    /// An environment variable (replaces the base's value of K)
    #[arg(long, value_name = "K=V")]
    pub env: Vec<String>,
    /// The working directory
    #[arg(long, value_name = "PATH")]
    pub workdir: Option<String>,
    /// A label
    #[arg(long, value_name = "K=V")]
    pub label: Vec<String>,
    /// The layout holding the base image
    #[arg(long, value_name = "DIR", requires = "base_ref")]
    pub base_layout: Option<PathBuf>,
    /// The base image's ref (or sha256 digest) in --base-layout
    #[arg(long, value_name = "REF", requires = "base_layout")]
    pub base_ref: Option<String>,
    /// The layer's compression: gzip, zstd or none
    #[arg(long, value_name = "ALGO", default_value = "gzip")]
    pub compression: String,
    /// Compression threads [default: the cores available]; changes speed, never bytes
    #[arg(long, value_name = "N")]
    pub threads: Option<usize>,
    /// Also write an SPDX 2.3 SBOM of the layer's files, attached to the image as a referrer
    #[arg(long)]
    pub sbom: bool,
    /// Print a JSON object (docs/oci.md) instead of the manifest digest
    #[arg(long)]
    pub json: bool,
}

/// `oci index` flags.
#[derive(Args, Debug)]
pub struct IndexArgs {
    /// The OCI layout holding the manifests
    #[arg(long, value_name = "DIR")]
    pub layout: PathBuf,
    /// The name to give the index in index.json
    #[arg(long = "ref", value_name = "REF")]
    pub ref_name: String,
    /// Per-platform images of the layout (refs or sha256 digests), in the index's order:
    /// `--manifest A B` or `--manifest A --manifest B`
    #[arg(long, value_name = "REF", required = true, num_args = 1..)]
    pub manifest: Vec<String>,
    /// Print a JSON object (docs/oci.md) instead of the index digest
    #[arg(long)]
    pub json: bool,
}

pub fn build(args: BuildArgs) -> Result<()> {
    let opts = BuildOptions {
        layout: args.layout,
        ref_name: args.ref_name,
        root: args.root,
        platform: args.platform,
        prefix: args.prefix,
        entrypoint: (!args.entrypoint.is_empty()).then_some(args.entrypoint),
        cmd: (!args.cmd.is_empty()).then_some(args.cmd),
        env: args.env,
        workdir: args.workdir,
        labels: args.label,
        base: args.base_layout.zip(args.base_ref),
        compression: Compression::parse(&args.compression)?,
        threads: args.threads.unwrap_or_else(compress::default_threads),
        sbom: args.sbom,
    };
    let built = build::build(&opts)?;
    let mut out = std::io::stdout().lock();
    if args.json {
        serde_json::to_writer_pretty(&mut out, &built)?;
        writeln!(out)?;
    } else {
        writeln!(out, "{}", built.manifest.digest)?;
        if let Some(sbom) = &built.sbom {
            writeln!(out, "{}", sbom.digest)?;
        }
    }
    Ok(())
}

pub fn index(args: IndexArgs) -> Result<()> {
    let layout = Layout::open(&args.layout)?;
    let descriptor = oci::local::image_index::write_index(&layout, &args.ref_name, &args.manifest)?;
    let mut out = std::io::stdout().lock();
    if args.json {
        let v =
            serde_json::json!({"layout": args.layout, "ref": args.ref_name, "index": descriptor});
        serde_json::to_writer_pretty(&mut out, &v)?;
        writeln!(out)?;
    } else {
        writeln!(out, "{}", descriptor.digest)?;
    }
    Ok(())
}

/// `oci inspect oci:DIR:REF` or `oci inspect oci:DIR@sha256:HEX`.
pub fn inspect(reference: &str, json: bool, raw: bool) -> Result<()> {
    let ImageRef::Layout(r) = reference.parse::<ImageRef>()? else {
        bail!("{reference} is not a layout reference: use oci:DIR:REF or oci:DIR@sha256:HEX");
    };
    let layout = Layout::open(&r.dir)?;
    let (inspection, bytes) = oci::local::inspect::inspect_layout(&layout, &r.image)?;
    let mut out = std::io::stdout().lock();
    if raw {
        out.write_all(&bytes)?;
    } else if json {
        serde_json::to_writer_pretty(&mut out, &inspection)?;
        writeln!(out)?;
    } else {
        out.write_all(inspection.text().as_bytes())?;
    }
    Ok(())
}
