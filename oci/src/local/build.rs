//! `oci build`: one reproducible layer from a folder, stacked on an optional base, written to a layout under a ref.
use crate::local::compress::{Compression, Encoder};
use crate::local::epoch::{self, EpochError};
use crate::local::layer::{self, LayerError, LayerFile};
use crate::local::layout::{self, Layout, LayoutError, RefOrDigest, Rollback};
use crate::local::sbom;
use crate::types::digest::{Digest, DigestWriter};
use crate::types::spec::{self, Descriptor, Platform, PlatformError};
use serde::Serialize;
use serde_json::{Value, json};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The platform of an image built without `--platform` or a base: fixed, so the host never shows.
pub const DEFAULT_PLATFORM: &str = "linux/amd64";

/// What to build. Strings are validated by [`build`], so every caller gets the same messages.
#[derive(Debug, Clone)]
pub struct BuildOptions {
    /// The layout to write (created when missing or empty).
    pub layout: PathBuf,
    /// The ref name to add or replace in `index.json`.
    pub ref_name: String,
    /// The folder whose contents become the layer.
    pub root: PathBuf,
    /// `OS/ARCH[/VARIANT]`; default: the base's, else [`DEFAULT_PLATFORM`].
    pub platform: Option<String>,
    /// Where the root goes in the image (absolute; `/` by default).
    pub prefix: String,
    /// The entrypoint, replacing the base's (and its cmd, unless `cmd` is given too).
    pub entrypoint: Option<Vec<String>>,
    /// The cmd, replacing the base's.
    pub cmd: Option<Vec<String>>,
    /// `K=V` pairs, replacing the base's value of `K` or added after its env.
    pub env: Vec<String>,
    /// The working directory.
    pub workdir: Option<String>,
    /// `K=V` labels.
    pub labels: Vec<String>,
    /// A base image: layout directory and ref (or digest).
    pub base: Option<(PathBuf, String)>,
    /// The layer's compression.
    pub compression: Compression,
    /// Compression workers; changes speed, never bytes.
    pub threads: usize,
    /// Also write an SPDX SBOM of the layer's files, attached to the image as a referrer.
    pub sbom: bool,
}

/// Why a build failed. Every message is one line naming the bad value or path.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error(transparent)]
    Layout(#[from] LayoutError),
    #[error(transparent)]
    Layer(#[from] LayerError),
    #[error(transparent)]
    Platform(#[from] PlatformError),
    #[error(transparent)]
    Epoch(#[from] EpochError),
    #[error("root {} does not exist: pass the folder to put in the image", .0.display())]
    RootMissing(PathBuf),
    #[error("root {} is not a directory: pass the folder to put in the image", .0.display())]
    RootNotADirectory(PathBuf),
    #[error("root {} is inside the layout {}: pass a root outside the layout", .root.display(), .layout.display())]
    RootInLayout { root: PathBuf, layout: PathBuf },
    #[error("bad prefix {0:?}: it must be an absolute path such as /app")]
    PrefixNotAbsolute(String),
    #[error("bad prefix {0:?}: it must not hold . or .. components")]
    PrefixDots(String),
    #[error("bad {what} {value:?}: expected KEY=VALUE with a non-empty KEY")]
    BadPair { what: &'static str, value: String },
    #[error("the base image is for {base}, not {asked}: drop --platform or use a base for {asked}")]
    PlatformMismatch { base: String, asked: String },
    #[error("the base index {base} has no manifest for {asked}: it has {have}")]
    NoBaseForPlatform {
        base: String,
        asked: String,
        have: String,
    },
    #[error("{what} {digest} is not a valid image document: {msg}")]
    BadDocument {
        what: &'static str,
        digest: Digest,
        msg: String,
    },
    #[error("cannot write the layer into {}: {source}", .dir.display())]
    Write {
        dir: PathBuf,
        source: std::io::Error,
    },
}

type Result<T> = std::result::Result<T, BuildError>;

/// What a build wrote; this is also the `--json` output (see docs/oci.md).
#[derive(Debug, Clone, Serialize)]
pub struct Built {
    /// The layout written.
    pub layout: PathBuf,
    /// The ref added or replaced.
    #[serde(rename = "ref")]
    pub ref_name: String,
    /// `OS/ARCH[/VARIANT]`.
    pub platform: String,
    /// The manifest's descriptor.
    pub manifest: Descriptor,
    /// The config's descriptor.
    pub config: Descriptor,
    /// The new layer's descriptor.
    pub layer: Descriptor,
    /// The digest of the new layer's uncompressed tar (its `rootfs.diff_ids` entry).
    #[serde(rename = "diffId")]
    pub diff_id: Digest,
    /// With `--sbom`: the SBOM's artifact manifest, as `index.json` lists it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sbom: Option<Descriptor>,
}

/// Splits an absolute prefix into components, refusing relative ones and `.` or `..`.
pub fn parse_prefix(prefix: &str) -> Result<Vec<Vec<u8>>> {
    let rest = prefix
        .strip_prefix('/')
        .ok_or_else(|| BuildError::PrefixNotAbsolute(prefix.to_string()))?;
    let mut parts = Vec::new();
    for c in rest.split('/').filter(|c| !c.is_empty()) {
        if c == "." || c == ".." {
            return Err(BuildError::PrefixDots(prefix.to_string()));
        }
        parts.push(c.as_bytes().to_vec());
    }
    Ok(parts)
}

fn split_pair<'a>(what: &'static str, value: &'a str) -> Result<(&'a str, &'a str)> {
    match value.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k, v)),
        _ => Err(BuildError::BadPair {
            what,
            value: value.to_string(),
        }),
    }
}

/// A base image, read and verified before anything is written.
struct Base {
    layout: Layout,
    /// The base's manifest (the platform's, when the ref names an index).
    descriptor: Descriptor,
    config: Value,
    layers: Vec<Descriptor>,
    platform: Platform,
}

/// The manifest and config of an image whose bytes were checked against their digests.
pub struct ImageDocs {
    /// The manifest's descriptor.
    pub descriptor: Descriptor,
    /// The manifest's config descriptor.
    pub config: Descriptor,
    /// The manifest's layers.
    pub layers: Vec<Descriptor>,
    /// The config, parsed (key order kept).
    pub config_json: Value,
}

/// Reads a manifest and its config from a layout, verifying both.
pub fn read_image(layout: &Layout, descriptor: &Descriptor) -> Result<ImageDocs> {
    let bytes = layout.read_blob(&descriptor.digest, Some(descriptor.size))?;
    let bad = |what, digest, e: serde_json::Error| BuildError::BadDocument {
        what,
        digest,
        msg: e.to_string(),
    };
    #[derive(serde::Deserialize)]
    struct Manifest {
        config: Descriptor,
        layers: Vec<Descriptor>,
    }
    let m: Manifest =
        serde_json::from_slice(&bytes).map_err(|e| bad("manifest", descriptor.digest, e))?;
    let config_bytes = layout.read_blob(&m.config.digest, Some(m.config.size))?;
    let config_json: Value =
        serde_json::from_slice(&config_bytes).map_err(|e| bad("config", m.config.digest, e))?;
    if !config_json.is_object() {
        return Err(BuildError::BadDocument {
            what: "config",
            digest: m.config.digest,
            msg: "it is not a JSON object".to_string(),
        });
    }
    Ok(ImageDocs {
        descriptor: descriptor.clone(),
        config: m.config,
        layers: m.layers,
        config_json,
    })
}

/// The platform a config declares.
pub fn config_platform(config: &Value) -> Platform {
    let s = |k: &str| config.get(k).and_then(Value::as_str).map(str::to_string);
    Platform {
        architecture: s("architecture").unwrap_or_default(),
        os: s("os").unwrap_or_default(),
        os_version: s("os.version"),
        os_features: None,
        variant: s("variant"),
    }
}

fn same_platform(a: &Platform, b: &Platform) -> bool {
    a.os == b.os
        && a.architecture == b.architecture
        && (a.variant.is_none() || b.variant.is_none() || a.variant == b.variant)
}

fn load_base(dir: &Path, name: &str, asked: Option<&Platform>) -> Result<Base> {
    let layout = Layout::open(dir)?;
    let mut descriptor = layout.resolve(&RefOrDigest::parse(name)?)?;
    if spec::is_index(&descriptor.media_type) {
        let bytes = layout.read_blob(&descriptor.digest, Some(descriptor.size))?;
        let index: spec::Index =
            serde_json::from_slice(&bytes).map_err(|e| BuildError::BadDocument {
                what: "index",
                digest: descriptor.digest,
                msg: e.to_string(),
            })?;
        let want = match asked {
            Some(p) => p.clone(),
            None => Platform::parse(DEFAULT_PLATFORM)?,
        };
        descriptor = index
            .manifests
            .iter()
            .find(|d| d.platform.as_ref().is_some_and(|p| same_platform(p, &want)))
            .cloned()
            .ok_or_else(|| BuildError::NoBaseForPlatform {
                base: name.to_string(),
                asked: want.to_string(),
                have: index
                    .manifests
                    .iter()
                    .filter_map(|d| d.platform.as_ref().map(Platform::to_string))
                    .collect::<Vec<_>>()
                    .join(", "),
            })?;
    }
    let docs = read_image(&layout, &descriptor)?;
    let platform = config_platform(&docs.config_json);
    if let Some(asked) = asked
        && !same_platform(asked, &platform)
    {
        return Err(BuildError::PlatformMismatch {
            base: platform.to_string(),
            asked: asked.to_string(),
        });
    }
    Ok(Base {
        layout,
        descriptor,
        config: docs.config_json,
        layers: docs.layers,
        platform,
    })
}

/// Builds the image and points `ref_name` at it. On any error the layout is left exactly as it was.
pub fn build(opts: &BuildOptions) -> Result<Built> {
    // Everything that can be checked without writing is checked first.
    layout::validate_ref_name(&opts.ref_name)?;
    let prefix = parse_prefix(&opts.prefix)?;
    let asked = opts.platform.as_deref().map(Platform::parse).transpose()?;
    for e in &opts.env {
        split_pair("env", e)?;
    }
    for l in &opts.labels {
        split_pair("label", l)?;
    }
    let epoch = epoch::source_date_epoch()?;
    match std::fs::metadata(&opts.root) {
        Err(_) => return Err(BuildError::RootMissing(opts.root.clone())),
        Ok(m) if !m.is_dir() => return Err(BuildError::RootNotADirectory(opts.root.clone())),
        Ok(_) => {}
    }
    layout::probe(&opts.layout)?;
    let base = opts
        .base
        .as_ref()
        .map(|(dir, name)| load_base(dir, name, asked.as_ref()))
        .transpose()?;
    let platform = match (&base, asked) {
        (Some(b), _) => b.platform.clone(),
        (None, Some(p)) => p,
        (None, None) => Platform::parse(DEFAULT_PLATFORM)?,
    };

    let (layout, mut rollback) = Layout::create_locked(&opts.layout)?;
    let skip = layout_in_root(&opts.root, &opts.layout)?;

    // Base layers first: a corrupt base blob must be found before a new blob could overwrite it.
    let mut layers = Vec::new();
    if let Some(base) = &base {
        for d in &base.layers {
            let c = layout.copy_blob_from(&base.layout, &d.digest, Some(d.size))?;
            rollback.track(&c);
            layers.push(d.clone());
        }
    }
    let mut files = opts.sbom.then(Vec::new);
    let (layer, diff_id) = write_layer(
        &layout,
        &mut rollback,
        opts,
        &prefix,
        epoch,
        skip,
        files.as_mut(),
    )?;
    layers.push(layer.clone());

    let created = epoch::rfc3339(epoch);
    let config_json = image_config(
        base.as_ref().map(|b| &b.config),
        opts,
        &platform,
        &diff_id,
        &created,
    );
    let config = commit_json(
        &layout,
        &mut rollback,
        spec::MEDIA_TYPE_CONFIG,
        &spec::to_json_bytes(&config_json),
    )?;
    let manifest_json = json!({
        "schemaVersion": 2,
        "mediaType": spec::MEDIA_TYPE_MANIFEST,
        "config": config,
        "layers": layers,
    });
    let manifest = commit_json(
        &layout,
        &mut rollback,
        spec::MEDIA_TYPE_MANIFEST,
        &spec::to_json_bytes(&manifest_json),
    )?;
    let sbom = match &files {
        Some(files) => {
            let described = sbom::Described {
                name: &opts.ref_name,
                manifest: &manifest,
                base: base
                    .as_ref()
                    .zip(opts.base.as_ref())
                    .map(|(b, (_, name))| (name.as_str(), &b.descriptor.digest)),
            };
            let document = sbom::document(&described, files, &created);
            Some(sbom::attach(
                &layout,
                &mut rollback,
                &manifest,
                &document,
                &created,
            )?)
        }
        None => None,
    };
    // The ref and the SBOM's entry land in one replacement of index.json, or neither does.
    layout.set_ref_with_untagged(&opts.ref_name, &manifest, sbom.as_slice())?;
    rollback.keep();
    Ok(Built {
        layout: opts.layout.clone(),
        ref_name: opts.ref_name.clone(),
        platform: platform.to_string(),
        manifest,
        config,
        layer,
        diff_id,
        sbom,
    })
}

/// The layout's directory (device, inode) when it lies inside the root, so the walk leaves it out:
/// an image never holds its own layout (nor the blob being written). A root inside the layout, or the
/// layout itself, is refused.
fn layout_in_root(root: &Path, layout: &Path) -> Result<Option<(u64, u64)>> {
    use std::os::unix::fs::MetadataExt;
    let canonical = |p: &Path| {
        p.canonicalize().map_err(|source| {
            BuildError::Layer(LayerError::Read {
                path: p.to_path_buf(),
                source,
            })
        })
    };
    let (root_abs, layout_abs) = (canonical(root)?, canonical(layout)?);
    if root_abs.starts_with(&layout_abs) {
        return Err(BuildError::RootInLayout {
            root: root.to_path_buf(),
            layout: layout.to_path_buf(),
        });
    }
    if !layout_abs.starts_with(&root_abs) {
        return Ok(None);
    }
    let m = std::fs::metadata(&layout_abs).map_err(|source| {
        BuildError::Layer(LayerError::Read {
            path: layout.to_path_buf(),
            source,
        })
    })?;
    Ok(Some((m.dev(), m.ino())))
}

/// Writes a JSON document as a blob and returns its descriptor.
pub fn commit_json(
    layout: &Layout,
    rollback: &mut Rollback,
    media_type: &str,
    bytes: &[u8],
) -> Result<Descriptor> {
    let c = layout.write_blob(bytes)?;
    rollback.track(&c);
    Ok(Descriptor::new(media_type, c.digest, c.size))
}

/// Streams the layer into a blob; returns its descriptor and the uncompressed tar's digest.
/// With `files`, the layer's regular files are recorded there on the way.
fn write_layer(
    layout: &Layout,
    rollback: &mut Rollback,
    opts: &BuildOptions,
    prefix: &[Vec<u8>],
    epoch: u64,
    skip: Option<(u64, u64)>,
    files: Option<&mut Vec<LayerFile>>,
) -> Result<(Descriptor, Digest)> {
    let io = |source| BuildError::Write {
        dir: opts.layout.clone(),
        source,
    };
    let blob = layout.blob_writer()?;
    let (blob, diff_id) = if opts.compression == Compression::None {
        // The blob is the tar: one hash serves as both digests.
        let mut blob = blob;
        layer::write_layer_listing(&opts.root, prefix, epoch, skip, &mut blob, files)?;
        (blob, None)
    } else {
        let mut tar =
            DigestWriter::new(Encoder::new(opts.compression, blob, opts.threads).map_err(io)?);
        layer::write_layer_listing(&opts.root, prefix, epoch, skip, &mut tar, files)?;
        let (encoder, diff_id, _) = tar.finish();
        (encoder.finish().map_err(io)?, Some(diff_id))
    };
    let mut blob = blob;
    blob.flush().map_err(io)?;
    let c = blob.commit(None)?;
    rollback.track(&c);
    Ok((
        Descriptor::new(opts.compression.media_type(), c.digest, c.size),
        diff_id.unwrap_or(c.digest),
    ))
}

/// The image config: the base's (key order kept) or a fresh one, with this build's changes.
fn image_config(
    base: Option<&Value>,
    opts: &BuildOptions,
    platform: &Platform,
    diff_id: &Digest,
    created: &str,
) -> Value {
    let mut cfg = match base {
        Some(b) => b.clone(),
        None => {
            let mut v = json!({"created": created, "architecture": platform.architecture, "os": platform.os});
            if let Some(variant) = &platform.variant {
                v["variant"] = json!(variant);
            }
            v
        }
    };
    let obj = cfg
        .as_object_mut()
        // Cannot fail: the config was checked to be a JSON object when it was read.
        .expect("configs are checked to be objects");
    obj.insert("created".into(), json!(created));
    let run = obj.entry("config").or_insert_with(|| json!({}));
    if !run.is_object() {
        *run = json!({});
    }
    // Cannot fail: the line above put an object there.
    let run = run.as_object_mut().expect("just made an object");
    if !opts.env.is_empty() {
        let mut env: Vec<String> = run
            .get("Env")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default();
        for pair in &opts.env {
            let key = pair.split_once('=').map_or(pair.as_str(), |(k, _)| k);
            match env
                .iter_mut()
                .find(|e| e.split_once('=').map_or(e.as_str(), |(k, _)| k) == key)
            {
                Some(slot) => *slot = pair.clone(),
                None => env.push(pair.clone()),
            }
        }
        run.insert("Env".into(), json!(env));
    }
    if let Some(entrypoint) = &opts.entrypoint {
        run.insert("Entrypoint".into(), json!(entrypoint));
        // As in Dockerfiles: a new entrypoint drops the base's cmd, which was meant for the old one.
        if opts.cmd.is_none() {
            run.remove("Cmd");
        }
    }
    if let Some(cmd) = &opts.cmd {
        run.insert("Cmd".into(), json!(cmd));
    }
    if let Some(dir) = &opts.workdir {
        run.insert("WorkingDir".into(), json!(dir));
    }
    if !opts.labels.is_empty() {
        let labels = run.entry("Labels").or_insert_with(|| json!({}));
        if !labels.is_object() {
            *labels = json!({});
        }
        // Cannot fail: the line above put an object there.
        let labels = labels.as_object_mut().expect("just made an object");
        for pair in &opts.labels {
            // Cannot fail: labels were checked to hold `=` before the build began.
            let (k, v) = pair.split_once('=').expect("labels are checked first");
            labels.insert(k.to_string(), json!(v));
        }
    }
    let rootfs = obj
        .entry("rootfs")
        .or_insert_with(|| json!({"type": "layers", "diff_ids": []}));
    if let Some(ids) = rootfs.get_mut("diff_ids").and_then(Value::as_array_mut) {
        ids.push(json!(diff_id));
    } else {
        rootfs["diff_ids"] = json!([diff_id]);
    }
    let history = obj.entry("history").or_insert_with(|| json!([]));
    let entry = json!({"created": created, "created_by": "oci build"});
    match history.as_array_mut() {
        Some(h) => h.push(entry),
        None => *history = json!([entry]),
    }
    cfg
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_must_be_absolute_without_dots() {
        assert_eq!(parse_prefix("/").unwrap(), Vec::<Vec<u8>>::new());
        assert_eq!(
            parse_prefix("/opt//app/").unwrap(),
            vec![b"opt".to_vec(), b"app".to_vec()]
        );
        assert_eq!(
            parse_prefix("app").unwrap_err().to_string(),
            "bad prefix \"app\": it must be an absolute path such as /app"
        );
        assert_eq!(
            parse_prefix("/a/../b").unwrap_err().to_string(),
            "bad prefix \"/a/../b\": it must not hold . or .. components"
        );
    }
}
