//! The commands about what refers to an image: `referrers`, `attach`, `sign`, `verify` (its
//! signatures and, with `--sbom`, its SBOMs against its layer).
use crate::remote_cli::{TlsArgs, parse_ref, runtime, warn_skipped};
use anyhow::{Result, bail};
use clap::Args;
use oci::signing::cosign;
use oci::signing::keys::{PublicKey, SigningKey};
use oci::transfer::attach::{self, Attachment};
use oci::transfer::endpoint::Endpoint;
use oci::transfer::push::{BlobOptions, DEFAULT_JOBS};
use oci::transfer::referrers::Link;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;

/// `oci referrers REF`
#[derive(Args, Debug)]
pub struct ReferrersArgs {
    /// oci:DIR:REF, oci:DIR@sha256:HEX or docker://HOST[:PORT]/REPO[:TAG|@sha256:HEX]
    pub reference: String,
    /// Only referrers of this artifact type
    #[arg(long, value_name = "TYPE")]
    pub artifact_type: Option<String>,
    /// Print a JSON array
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub tls: TlsArgs,
}

/// `oci attach REF --artifact-type T --file F`
#[derive(Args, Debug)]
pub struct AttachArgs {
    /// The image the artifact refers to
    pub reference: String,
    /// The artifact's type, a media type (application/spdx+json, ...)
    #[arg(long, value_name = "TYPE")]
    pub artifact_type: String,
    /// The file to attach
    #[arg(long, value_name = "FILE")]
    pub file: PathBuf,
    /// The file's media type as a layer
    #[arg(long, value_name = "TYPE", default_value = "application/octet-stream")]
    pub media_type: String,
    /// An annotation on the artifact (repeatable)
    #[arg(long, value_name = "KEY=VALUE", value_parser = parse_annotation)]
    pub annotation: Vec<(String, String)>,
    #[command(flatten)]
    pub tls: TlsArgs,
}

/// `oci sign REF --key KEY`
#[derive(Args, Debug)]
pub struct SignArgs {
    /// The image to sign
    pub reference: String,
    /// The ECDSA P-256 private key, PEM (PKCS#8 or SEC1)
    #[arg(long, value_name = "KEY")]
    pub key: PathBuf,
    /// Print a JSON object instead of the signatures' digest
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub tls: TlsArgs,
}

/// `oci verify REF --key PUB [--sbom]`
#[derive(Args, Debug)]
pub struct VerifyArgs {
    /// The image to check
    pub reference: String,
    /// A public key, PEM; the image passes if one of them signed it (repeatable)
    #[arg(long, value_name = "PUB", required_unless_present = "sbom")]
    pub key: Vec<PathBuf>,
    /// Check that every SPDX SBOM referring to the image describes it and lists exactly the
    /// regular files of its last layer (path, SHA-256, size, mode)
    #[arg(long)]
    pub sbom: bool,
    /// Print a JSON object
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub tls: TlsArgs,
}

fn parse_annotation(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("{s:?} is not KEY=VALUE")),
    }
}

fn blob_options() -> BlobOptions {
    BlobOptions {
        jobs: DEFAULT_JOBS,
        chunk_size: None,
    }
}

/// Opens the reference; `writing` takes a layout's writer lock (and never makes a layout).
fn open(reference: &str, tls: &TlsArgs, writing: bool) -> Result<Endpoint> {
    let image = parse_ref(reference)?;
    if let oci::transfer::reference::ImageRef::Layout(l) = &image
        && writing
        && !l.dir.join("oci-layout").exists()
    {
        bail!(
            "{} is not an OCI layout (no oci-layout file): build or copy the image there first",
            l.dir.display()
        );
    }
    Ok(Endpoint::open(
        &image,
        &tls.options(),
        tls.creds.as_deref(),
        writing,
    )?)
}

pub fn referrers(args: ReferrersArgs) -> Result<()> {
    let found = runtime()?.block_on(async {
        let ep = open(&args.reference, &args.tls, false)?;
        let image = ep.top_manifest().await?;
        // An index's referrers and those of each platform's manifest, as `copy` carries them.
        let mut roots = vec![image.digest];
        if oci::types::spec::is_index(&image.media_type)
            && let Ok(index) = serde_json::from_slice::<oci::types::spec::Index>(&image.bytes)
        {
            roots.extend(index.manifests.iter().map(|m| m.digest));
        }
        let found = oci::transfer::carry::list(&ep, &roots, args.artifact_type.as_deref()).await?;
        Ok::<_, anyhow::Error>((image.digest, found))
    })?;
    let (image, found) = found;
    warn_skipped(&found.skipped);
    let mut out = std::io::stdout().lock();
    if args.json {
        let rows: Vec<serde_json::Value> = found
            .referrers
            .iter()
            .map(|r| {
                serde_json::json!({
                    "artifactType": r.artifact_type,
                    "mediaType": r.manifest.media_type,
                    "digest": r.manifest.digest,
                    "size": r.manifest.bytes.len(),
                    "annotations": r.annotations,
                    "subject": r.subject,
                    "depth": r.depth,
                    "tag": match &r.link { Link::Tag(t) => Some(t.as_str()), Link::Subject => None },
                })
            })
            .collect();
        serde_json::to_writer_pretty(&mut out, &rows)?;
        writeln!(out)?;
        return Ok(());
    }
    for r in &found.referrers {
        let via = match &r.link {
            Link::Tag(t) => format!(" tag={t}"),
            Link::Subject => String::new(),
        };
        // What refers to one platform's manifest of an index says which.
        let of = match r.depth == 0 && r.subject != image {
            true => format!(" subject={}", r.subject),
            false => String::new(),
        };
        let notes: Vec<String> = r
            .annotations
            .iter()
            .map(|(k, v)| format!(" {k}={v}"))
            .collect();
        writeln!(
            out,
            "{}{} {} {}{via}{of}{}",
            "  ".repeat(r.depth),
            r.artifact_type,
            r.manifest.digest,
            r.manifest.bytes.len(),
            notes.concat()
        )?;
    }
    Ok(())
}

pub fn attach(args: AttachArgs) -> Result<()> {
    if !attach::is_media_type(&args.artifact_type) {
        bail!(
            "--artifact-type {:?} is not a media type: give TYPE/SUBTYPE, such as application/spdx+json",
            args.artifact_type
        );
    }
    if !attach::is_media_type(&args.media_type) {
        bail!(
            "--media-type {:?} is not a media type: give TYPE/SUBTYPE, such as application/json",
            args.media_type
        );
    }
    if !args.file.is_file() {
        bail!(
            "--file {} is not a readable file: give the file to attach",
            args.file.display()
        );
    }
    let what = Attachment {
        artifact_type: &args.artifact_type,
        file: &args.file,
        media_type: &args.media_type,
        annotations: args.annotation.into_iter().collect::<BTreeMap<_, _>>(),
    };
    let digest = runtime()?.block_on(async {
        let ep = open(&args.reference, &args.tls, true)?;
        let digest = attach::attach(&ep, &what, &blob_options()).await?;
        ep.finish();
        Ok::<_, anyhow::Error>(digest)
    })?;
    println!("{digest}");
    Ok(())
}

pub fn sign(args: SignArgs) -> Result<()> {
    let key = SigningKey::read(&args.key)?;
    let signed = runtime()?.block_on(async {
        let ep = open(&args.reference, &args.tls, true)?;
        let signed = cosign::sign(&ep, &key, &blob_options()).await?;
        ep.finish();
        Ok::<_, anyhow::Error>(signed)
    })?;
    let mut out = std::io::stdout().lock();
    if args.json {
        serde_json::to_writer_pretty(&mut out, &signed)?;
        writeln!(out)?;
    } else {
        writeln!(out, "{}", signed.signatures)?;
    }
    Ok(())
}

pub fn verify(args: VerifyArgs) -> Result<()> {
    let keys = args
        .key
        .iter()
        .map(|p| PublicKey::read(p))
        .collect::<Result<Vec<_>, _>>()?;
    let (verified, sboms) = runtime()?.block_on(async {
        let ep = open(&args.reference, &args.tls, false)?;
        let verified = match keys.is_empty() {
            true => None,
            false => Some(cosign::verify(&ep, &keys).await?),
        };
        let sboms = match args.sbom {
            true => Some(oci::signing::sbom_check::check(&ep).await?),
            false => None,
        };
        Ok::<_, anyhow::Error>((verified, sboms))
    })?;
    let mut out = std::io::stdout().lock();
    if args.json {
        let mut answer = serde_json::to_value(&verified)?;
        if let Some(sboms) = &sboms {
            let sboms = serde_json::to_value(sboms)?;
            match &mut answer {
                serde_json::Value::Object(o) => {
                    o.insert("sboms".into(), sboms);
                }
                other => *other = serde_json::json!({ "sboms": sboms }),
            }
        }
        serde_json::to_writer_pretty(&mut out, &answer)?;
        writeln!(out)?;
        return Ok(());
    }
    if let Some(v) = &verified {
        writeln!(out, "{} signed by {} ({})", v.image, v.key, v.found_in)?;
    }
    for s in sboms.iter().flatten() {
        writeln!(
            out,
            "SBOM {} lists the {} files of layer {} exactly",
            s.sbom, s.files, s.layer
        )?;
    }
    Ok(())
}
