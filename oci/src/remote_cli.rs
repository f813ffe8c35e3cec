//! The network commands of the `oci` binary: `push`, `copy` and `inspect docker://...`, their flags and output.
use anyhow::{Context, Result};
use clap::Args;
use oci::transfer::copy::{self, CopyOptions, Report};
use oci::transfer::endpoint::Endpoint;
use oci::transfer::push::{BlobOptions, DEFAULT_JOBS};
use oci::transfer::reference::ImageRef;
use oci::transfer::remote::Client;
use oci::transfer::tls::TlsOptions;
use oci::types::spec::Platform;
use std::io::Write;
use std::path::PathBuf;

/// TLS and credentials for a registry.
#[derive(Args, Debug, Clone, Default)]
pub struct TlsArgs {
    /// PEM client certificate to present (mutual TLS)
    #[arg(long, value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert
    #[arg(long, value_name = "FILE")]
    pub tls_key: Option<PathBuf>,
    /// PEM CA certificate(s) to trust besides the system's
    #[arg(long, value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
    /// Docker-style per-host certificate folders (DIR/HOST:PORT/{ca.crt,client.cert,client.key})
    #[arg(long, value_name = "DIR", default_value = oci::transfer::tls::DEFAULT_CERTS_DIR)]
    pub certs_dir: PathBuf,
    /// Talk plain HTTP to the registry (no TLS)
    #[arg(long)]
    pub plain_http: bool,
    /// USER:PASS for the registry (else $OCI_CREDS, REGISTRY_AUTH_FILE, Docker's config.json)
    #[arg(long, value_name = "USER:PASS")]
    pub creds: Option<String>,
}

impl TlsArgs {
    pub fn options(&self) -> TlsOptions {
        TlsOptions {
            cert: self.tls_cert.clone(),
            key: self.tls_key.clone(),
            ca: self.tls_ca.clone(),
            certs_dir: Some(self.certs_dir.clone()),
            plain_http: self.plain_http,
        }
    }
}

/// How blobs move.
#[derive(Args, Debug, Clone)]
pub struct TransferArgs {
    /// Blobs transferred at once (largest first)
    #[arg(long, default_value_t = DEFAULT_JOBS, value_name = "N")]
    pub jobs: usize,
    /// Upload in PATCH chunks of this many bytes instead of one streamed PUT
    #[arg(long, value_name = "BYTES")]
    pub chunk_size: Option<u64>,
    /// Copy only this platform of an index (OS/ARCH[/VARIANT]; repeatable)
    #[arg(long, value_name = "PLATFORM", value_parser = parse_platform)]
    pub platform: Vec<Platform>,
    /// Print a JSON object instead of the digest
    #[arg(long)]
    pub json: bool,
    /// No progress bars even on a terminal
    #[arg(long)]
    pub quiet: bool,
    /// Leave behind what refers to the image (signatures, SBOMs, attestations)
    #[arg(long)]
    pub no_referrers: bool,
    /// Carry only referrers of this artifact type (what refers to them comes along)
    #[arg(long, value_name = "TYPE", conflicts_with = "no_referrers")]
    pub artifact_type: Option<String>,
}

fn parse_platform(s: &str) -> Result<Platform, String> {
    Platform::parse(s).map_err(|e| e.to_string())
}

/// `oci push oci:DIR:REF docker://HOST/REPO[:TAG]`
#[derive(Args, Debug)]
pub struct PushArgs {
    /// The image to push: oci:DIR:REF or oci:DIR@sha256:HEX
    pub source: String,
    /// Where to: docker://HOST[:PORT]/REPO[:TAG|@sha256:HEX]
    pub destination: String,
    #[command(flatten)]
    pub tls: TlsArgs,
    #[command(flatten)]
    pub transfer: TransferArgs,
}

/// `oci copy SRC DST`
#[derive(Args, Debug)]
pub struct CopyArgs {
    /// oci:DIR:REF, oci:DIR@sha256:HEX or docker://HOST[:PORT]/REPO[:TAG|@sha256:HEX]
    pub source: String,
    /// oci:DIR:REF or docker://HOST[:PORT]/REPO[:TAG]
    pub destination: String,
    /// Defaults for both sides
    #[command(flatten)]
    pub tls: TlsArgs,
    #[command(flatten)]
    pub src: SrcArgs,
    #[command(flatten)]
    pub dest: DestArgs,
    #[command(flatten)]
    pub transfer: TransferArgs,
}

/// The source side's own TLS and credentials (override the plain flags).
#[derive(Args, Debug, Clone)]
pub struct SrcArgs {
    /// PEM client certificate for the source registry
    #[arg(long, value_name = "FILE")]
    pub src_tls_cert: Option<PathBuf>,
    /// PEM private key of --src-tls-cert
    #[arg(long, value_name = "FILE")]
    pub src_tls_key: Option<PathBuf>,
    /// PEM CA certificate(s) to trust for the source registry
    #[arg(long, value_name = "FILE")]
    pub src_tls_ca: Option<PathBuf>,
    /// certs.d folder for the source registry
    #[arg(long, value_name = "DIR")]
    pub src_certs_dir: Option<PathBuf>,
    /// Plain HTTP to the source registry
    #[arg(long)]
    pub src_plain_http: bool,
    /// USER:PASS for the source registry
    #[arg(long, value_name = "USER:PASS")]
    pub src_creds: Option<String>,
}

/// The destination side's own TLS and credentials (override the plain flags).
#[derive(Args, Debug, Clone)]
pub struct DestArgs {
    /// PEM client certificate for the destination registry
    #[arg(long, value_name = "FILE")]
    pub dest_tls_cert: Option<PathBuf>,
    /// PEM private key of --dest-tls-cert
    #[arg(long, value_name = "FILE")]
    pub dest_tls_key: Option<PathBuf>,
    /// PEM CA certificate(s) to trust for the destination registry
    #[arg(long, value_name = "FILE")]
    pub dest_tls_ca: Option<PathBuf>,
    /// certs.d folder for the destination registry
    #[arg(long, value_name = "DIR")]
    pub dest_certs_dir: Option<PathBuf>,
    /// Plain HTTP to the destination registry
    #[arg(long)]
    pub dest_plain_http: bool,
    /// USER:PASS for the destination registry
    #[arg(long, value_name = "USER:PASS")]
    pub dest_creds: Option<String>,
}

impl SrcArgs {
    /// The source's flags: its own where given, else the shared ones.
    fn over(&self, shared: &TlsArgs) -> TlsArgs {
        TlsArgs {
            tls_cert: self
                .src_tls_cert
                .clone()
                .or_else(|| shared.tls_cert.clone()),
            tls_key: self.src_tls_key.clone().or_else(|| shared.tls_key.clone()),
            tls_ca: self.src_tls_ca.clone().or_else(|| shared.tls_ca.clone()),
            certs_dir: self
                .src_certs_dir
                .clone()
                .unwrap_or_else(|| shared.certs_dir.clone()),
            plain_http: self.src_plain_http || shared.plain_http,
            creds: self.src_creds.clone().or_else(|| shared.creds.clone()),
        }
    }
}

impl DestArgs {
    /// The destination's flags: its own where given, else the shared ones.
    fn over(&self, shared: &TlsArgs) -> TlsArgs {
        TlsArgs {
            tls_cert: self
                .dest_tls_cert
                .clone()
                .or_else(|| shared.tls_cert.clone()),
            tls_key: self.dest_tls_key.clone().or_else(|| shared.tls_key.clone()),
            tls_ca: self.dest_tls_ca.clone().or_else(|| shared.tls_ca.clone()),
            certs_dir: self
                .dest_certs_dir
                .clone()
                .unwrap_or_else(|| shared.certs_dir.clone()),
            plain_http: self.dest_plain_http || shared.plain_http,
            creds: self.dest_creds.clone().or_else(|| shared.creds.clone()),
        }
    }
}

/// `oci inspect docker://...`
#[derive(Args, Debug)]
pub struct RemoteInspectArgs {
    /// Print a JSON object
    #[arg(long)]
    pub json: bool,
    /// Print the manifest's exact bytes
    #[arg(long, conflicts_with = "json")]
    pub raw: bool,
    #[command(flatten)]
    pub tls: TlsArgs,
}

pub fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

pub fn parse_ref(s: &str) -> Result<ImageRef> {
    Ok(s.parse::<ImageRef>()?)
}

pub fn push(args: PushArgs) -> Result<()> {
    let src = parse_ref(&args.source)?;
    if !matches!(src, ImageRef::Layout(_)) {
        anyhow::bail!(
            "push reads an image from a layout: the source must be oci:DIR:REF or oci:DIR@sha256:HEX (use oci copy for {})",
            args.source
        );
    }
    let dst = parse_ref(&args.destination)?;
    if !matches!(dst, ImageRef::Registry(_)) {
        anyhow::bail!(
            "push sends an image to a registry: the destination must be docker://HOST[:PORT]/REPO[:TAG] (use oci copy for {})",
            args.destination
        );
    }
    transfer(&src, &args.tls, &dst, &args.tls, &args.transfer)
}

pub fn copy(args: CopyArgs) -> Result<()> {
    let src = parse_ref(&args.source)?;
    let dst = parse_ref(&args.destination)?;
    let src_tls = args.src.over(&args.tls);
    let dst_tls = args.dest.over(&args.tls);
    transfer(&src, &src_tls, &dst, &dst_tls, &args.transfer)
}

fn transfer(
    src: &ImageRef,
    src_tls: &TlsArgs,
    dst: &ImageRef,
    dst_tls: &TlsArgs,
    t: &TransferArgs,
) -> Result<()> {
    let options = CopyOptions {
        blobs: BlobOptions {
            jobs: t.jobs,
            chunk_size: t.chunk_size,
        },
        platforms: t.platform.clone(),
        quiet: t.quiet || t.json,
        referrers: !t.no_referrers,
        artifact_type: t.artifact_type.clone(),
    };
    let report = runtime()?.block_on(async {
        let from = Endpoint::open(src, &src_tls.options(), src_tls.creds.as_deref(), false)?;
        let to = Endpoint::open(dst, &dst_tls.options(), dst_tls.creds.as_deref(), true)?;
        let report = copy::copy(&from, &to, &options).await?;
        to.finish();
        Ok::<_, oci::transfer::endpoint::CopyError>(report)
    })?;
    if let Some(carried) = &report.referrers {
        warn_skipped(&carried.skipped);
    }
    print_report(&report, t.json)
}

/// One line on stderr for each listed artifact that was not taken.
pub fn warn_skipped(lines: &[String]) {
    for line in lines {
        eprintln!("oci: {line}");
    }
}

fn print_report(report: &Report, json: bool) -> Result<()> {
    let mut out = std::io::stdout().lock();
    if json {
        serde_json::to_writer_pretty(&mut out, report)?;
        writeln!(out)?;
    } else {
        writeln!(out, "{}", report.digest)?;
    }
    Ok(())
}

/// Whether `inspect` should go to the registry for this reference.
pub fn is_remote(reference: &str) -> bool {
    reference.starts_with("docker://")
}

pub fn inspect(reference: &str, args: &RemoteInspectArgs) -> Result<()> {
    let ImageRef::Registry(r) = parse_ref(reference)? else {
        anyhow::bail!(
            "inspect over the network needs docker://HOST[:PORT]/REPO[:TAG|@sha256:HEX], not {reference}"
        );
    };
    let (inspection, raw) = runtime()?.block_on(async {
        let credential = oci::transfer::auth::find(&r.host, args.tls.creds.as_deref())
            .map_err(oci::transfer::remote::RemoteError::from)?;
        let client = Client::new(&r.host, &args.tls.options(), credential)?;
        copy::inspect_registry(&client, &r).await
    })?;
    // The same output as for a layout image, from the same summary.
    let mut out = std::io::stdout().lock();
    if args.raw {
        out.write_all(&raw)?;
    } else if args.json {
        serde_json::to_writer_pretty(&mut out, &inspection)?;
        writeln!(out)?;
    } else {
        out.write_all(inspection.text().as_bytes())?;
    }
    Ok(())
}
