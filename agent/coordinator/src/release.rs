//! The release files an operator makes and checks (`fleet-coordinator release ...`): keys, a
//! release key's certificate, and a release folder's signed manifest over the binaries inside
//! its `hub-linux-<arch>.tar.gz` bundles. The format and the check are `fleet_proto::release`'s,
//! the ones the agent uses.
use crate::CoordinatorError;
use crate::bundles::bundle_path;
use fleet_proto::Digest;
use fleet_proto::pin::PinnedKey;
use fleet_proto::release::{
    CertifiedKey, ReleaseBinary, ReleaseManifest, ReleaseOffer, ReleaseSignature, ReleaseTrust,
    SigningKey, verify,
};
use sha2::{Digest as _, Sha256};
use std::io::Read;
use std::path::{Path, PathBuf};

/// The signed manifest in a release folder.
pub const MANIFEST_FILE: &str = "release.json";
/// Its signature, with the release key's certificate.
pub const SIGNATURE_FILE: &str = "release.sig";

/// The bundles of a release: the architecture in their name, and the target their binaries are.
pub const BUNDLE_TARGETS: &[(&str, &str)] = &[
    ("x86_64", "x86_64-unknown-linux-musl"),
    ("arm64", "aarch64-unknown-linux-musl"),
];

fn refused(line: String) -> CoordinatorError {
    CoordinatorError::Request(line)
}

/// A store's refusal of a read (a release that cannot be sent) as the operator's one line.
pub(crate) fn refusal_as_request(e: crate::store::StoreError) -> CoordinatorError {
    match e {
        crate::store::StoreError::Refused(line) => CoordinatorError::Request(line),
        e => e.into(),
    }
}

fn read(path: &Path, what: &str) -> Result<Vec<u8>, CoordinatorError> {
    std::fs::read(path).map_err(|e| refused(format!("cannot read {what} {}: {e}", path.display())))
}

fn write(path: &Path, bytes: &[u8], private: bool) -> Result<(), CoordinatorError> {
    let written = match private {
        true => fleet_content::files::write_private(path, bytes),
        false => fleet_content::files::write_public(path, bytes),
    };
    written.map_err(|e| refused(format!("cannot write {}: {e}", path.display())))
}

/// Makes a new signing key (a fleet root or a release key) at `out`, never over an existing one;
/// answers its public key.
pub fn keygen(out: &Path) -> Result<PinnedKey, CoordinatorError> {
    if out.exists() {
        return Err(refused(format!(
            "{} exists: a key is never overwritten (a lost root key cannot be made again); choose another path",
            out.display()
        )));
    }
    let (key, pem) = SigningKey::generate()?;
    write(out, pem.as_bytes(), true)?;
    Ok(key.public())
}

fn signing_key(path: &Path) -> Result<SigningKey, CoordinatorError> {
    let text = String::from_utf8(read(path, "the key")?)
        .map_err(|_| refused(format!("{} is not a PEM key file", path.display())))?;
    SigningKey::from_pem(&text).map_err(|e| refused(format!("{}: {e}", path.display())))
}

/// As the root in `root`, certifies the release key `key` (named `name`) into `out`.
pub fn certify(
    root: &Path,
    key: &PinnedKey,
    name: &str,
    out: &Path,
) -> Result<(), CoordinatorError> {
    let certified = signing_key(root)?.certify(key, name);
    let text = serde_json::to_vec_pretty(&certified).expect("a certificate serializes");
    write(out, &text, false)
}

/// What `release sign` puts in a manifest besides the binaries.
pub struct SignRequest {
    pub key: PathBuf,
    pub certificate: PathBuf,
    pub dir: PathBuf,
    pub version: String,
    pub sequence: u64,
    pub min_sequence: Option<u64>,
    pub expires_at_ms: u64,
    /// The fleet's roots from this release on (a rotation); empty: unchanged.
    pub roots: Vec<PinnedKey>,
    pub revoked_keys: Vec<PinnedKey>,
}

/// Signs the release in `request.dir`: its manifest over the binaries of both bundles, and the
/// signature beside it, each written whole or not at all (the signature last).
pub fn sign(request: &SignRequest) -> Result<ReleaseManifest, CoordinatorError> {
    let key = signing_key(&request.key)?;
    let certified: CertifiedKey =
        serde_json::from_slice(&read(&request.certificate, "the certificate")?).map_err(|e| {
            refused(format!(
                "{} is not a release key certificate: {e}",
                request.certificate.display()
            ))
        })?;
    let manifest = ReleaseManifest {
        version: request.version.clone(),
        sequence: request.sequence,
        min_sequence: request.min_sequence.unwrap_or(0),
        expires_at_ms: request.expires_at_ms,
        binaries: binaries_in(&request.dir)?,
        roots: request.roots.clone(),
        revoked_keys: request.revoked_keys.clone(),
    };
    if manifest.min_sequence > manifest.sequence {
        return Err(refused(format!(
            "--min-sequence {} is above --sequence {}: a release cannot forbid going back to itself",
            manifest.min_sequence, manifest.sequence
        )));
    }
    let bytes = serde_json::to_vec_pretty(&manifest).expect("a manifest serializes");
    let signature = key.sign_manifest(&bytes, &certified);
    let signature_text = serde_json::to_vec_pretty(&signature).expect("a signature serializes");
    // A signature that does not verify under its own certificate is a wrong key or certificate.
    let root = (certified.read()).map_err(|e| refused(e.to_string()))?.root;
    verify(&bytes, &signature, &ReleaseTrust::of_roots(vec![root]), 0).map_err(|e| {
        refused(format!(
            "the key {} does not go with the certificate {}: {e}",
            request.key.display(),
            request.certificate.display()
        ))
    })?;
    write(&request.dir.join(MANIFEST_FILE), &bytes, false)?;
    write(&request.dir.join(SIGNATURE_FILE), &signature_text, false)?;
    Ok(manifest)
}

/// Checks the release in `dir` as an agent would: its signature chain under `roots`, its expiry at
/// `now_ms`, and every binary in its bundles against the manifest.
pub fn verify_dir(
    dir: &Path,
    roots: &[PinnedKey],
    now_ms: u64,
) -> Result<ReleaseManifest, CoordinatorError> {
    let manifest = read(&dir.join(MANIFEST_FILE), "the manifest")?;
    let signature: ReleaseSignature =
        serde_json::from_slice(&read(&dir.join(SIGNATURE_FILE), "the signature")?).map_err(
            |e| {
                refused(format!(
                    "{} is not a release signature: {e}",
                    dir.join(SIGNATURE_FILE).display()
                ))
            },
        )?;
    let trust = ReleaseTrust::of_roots(roots.to_vec());
    let read = verify(&manifest, &signature, &trust, now_ms).map_err(|e| refused(e.to_string()))?;
    let held = binaries_in(dir)?;
    for want in &read.binaries {
        let got = held
            .iter()
            .find(|b| b.name == want.name && b.target == want.target);
        let Some(got) = got else {
            return Err(refused(format!(
                "the bundles hold no {} for {}, which the manifest names",
                want.name, want.target
            )));
        };
        want.check(&got.sha256, got.size)
            .map_err(|e| refused(e.to_string()))?;
    }
    Ok(read)
}

/// Every regular file in each bundle of `dir`, hashed; both bundles must be there.
fn binaries_in(dir: &Path) -> Result<Vec<ReleaseBinary>, CoordinatorError> {
    each_binary(
        dir,
        &mut |reader| hash(reader),
        &crate::progress::Progress::none(),
    )
}

/// Reads the release in `dir` and imports the binaries of its bundles into `blobs` by digest;
/// the coordinator checks the signature and that it holds each binary the manifest names.
/// On a terminal, `progress` shows each bundle as it is read.
pub fn offer(
    dir: &Path,
    blobs: &fleet_content::Blobs,
    progress: &crate::progress::Progress,
) -> Result<ReleaseOffer, CoordinatorError> {
    use base64::Engine;
    let manifest = read(&dir.join(MANIFEST_FILE), "the manifest")?;
    let signature_path = dir.join(SIGNATURE_FILE);
    let signature: ReleaseSignature =
        serde_json::from_slice(&read(&signature_path, "the signature")?).map_err(|e| {
            refused(format!(
                "{} is not a release signature: {e}",
                signature_path.display()
            ))
        })?;
    each_binary(dir, &mut |reader| blobs.import_from(reader), progress)?;
    Ok(ReleaseOffer {
        manifest: base64::engine::general_purpose::STANDARD.encode(manifest),
        signature,
    })
}

/// What is done with a binary's bytes: answers their digest and size.
type TakeBinary<'a> = dyn FnMut(&mut dyn Read) -> std::io::Result<(Digest, u64)> + 'a;

/// Calls `take` on every regular file in each bundle of `dir` (both must be there), which
/// answers its digest and size.
fn each_binary(
    dir: &Path,
    take: &mut TakeBinary,
    progress: &crate::progress::Progress,
) -> Result<Vec<ReleaseBinary>, CoordinatorError> {
    let mut binaries = Vec::new();
    for (arch, target) in BUNDLE_TARGETS {
        let path = bundle_path(dir, arch);
        let file = std::fs::File::open(&path).map_err(|e| {
            refused(format!("cannot read the bundle {} ({e}): a release holds both bundles; build them with `cargo xtask dist`", path.display()))
        })?;
        let unreadable = |e: std::io::Error| {
            refused(format!(
                "the bundle {} is not a readable tar.gz: {e}",
                path.display()
            ))
        };
        let size = file.metadata().map_or(0, |m| m.len());
        let bar = progress.bytes(
            &path.file_name().unwrap_or_default().to_string_lossy(),
            size,
        );
        let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(bar.wrap_read(file)));
        for entry in archive.entries().map_err(unreadable)? {
            let mut entry = entry.map_err(unreadable)?;
            if !entry.header().entry_type().is_file() {
                continue;
            }
            let entry_path = entry.path().map_err(unreadable)?;
            let Some(name) = entry_path
                .file_name()
                .and_then(|n| n.to_str())
                .map(str::to_string)
            else {
                continue;
            };
            let (sha256, size) = take(&mut entry).map_err(unreadable)?;
            binaries.push(ReleaseBinary {
                target: target.to_string(),
                name,
                sha256,
                size,
            });
        }
        bar.finish_and_clear();
    }
    Ok(binaries)
}

fn hash(reader: &mut dyn Read) -> std::io::Result<(Digest, u64)> {
    let mut hasher = Sha256::new();
    let size = std::io::copy(reader, &mut hasher)?;
    Ok((Digest::from_hasher(hasher), size))
}

/// What `release add` answers: the release as taken in, and whether it was new.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct TakenRelease {
    pub manifest: ReleaseManifest,
    pub new: bool,
}

impl crate::Coordinator {
    /// Takes in an offered release: its chain verified under the fleet's roots now, every binary
    /// it names held here (and, when `spread`, by enough coordinators of the fleet), then
    /// recorded, its sequence above every release's before it.
    pub(crate) async fn take_release(
        &self,
        offered: ReleaseOffer,
        spread: bool,
    ) -> Result<TakenRelease, CoordinatorError> {
        let trust = self.with_store(|store| store.release_trust()).await?;
        if trust.roots.is_empty() {
            return Err(refused(
                "this fleet trusts no release root yet: run `fleet-coordinator release trust --root ed25519:...` with the root's public key first".into(),
            ));
        }
        let now = fleet_proto::clock::now_ms();
        let manifest = (offered.verify(&trust, now)).map_err(|e| refused(e.to_string()))?;
        let missing = (manifest.binaries.iter()).find(|b| !self.blobs().has(&b.sha256));
        if let Some(b) = missing {
            return Err(refused(format!(
                "this coordinator holds no {} for {} ({}): run `release add` with the data folder of a coordinator of the fleet",
                b.name, b.target, b.sha256
            )));
        }
        if spread {
            let digests: Vec<Digest> = manifest.binaries.iter().map(|b| b.sha256).collect();
            self.spread(&digests).await?;
        }
        let record = crate::store::ReleaseRecord {
            manifest: offered.manifest,
            signature: offered.signature,
            manifest_read: manifest.clone(),
            added_at_ms: now,
        };
        let added = self
            .with_store(move |store| store.add_release(&record))
            .await?;
        Ok(TakenRelease {
            manifest,
            new: added == crate::store::ReleaseAdded::New,
        })
    }
}

/// What `update` answers: the node and the release it restarts into.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct UpdateSent {
    pub node_id: fleet_proto::NodeId,
    pub from: u64,
    pub to: u64,
}

impl crate::Coordinator {
    /// Has the node `wanted` take the release of `sequence` (the newest taken in when None):
    /// it checks it, installs it and restarts into it on trial; its facts say how that went.
    pub async fn update_node(
        &self,
        wanted: &str,
        sequence: Option<u64>,
    ) -> Result<UpdateSent, CoordinatorError> {
        let now = fleet_proto::clock::now_ms();
        let release = (self.with_store(move |store| store.sendable_release(sequence, now)))
            .await
            .map_err(refusal_as_request)?;
        let wanted = wanted.to_string();
        let node = (self.with_store(move |store| Ok(crate::nodes::find_node_in(store, &wanted))))
            .await??;
        match node.protocol {
            Some(crate::store::NodeProtocol::Speaks { version })
                if version >= fleet_proto::version::ProtocolVersion(2) => {}
            other => {
                return Err(refused(format!(
                    "node {} speaks {}: its agent predates self-update; replace the machine",
                    node.id,
                    other.map_or("no protocol yet".to_string(), |p| format!("protocol {p}"))
                )));
            }
        }
        self.send_update(&node.id, release.offer()).await
    }

    /// Sends the node `node_id` the release `offer` through its session, wherever it is held.
    pub(crate) async fn send_update(
        &self,
        node_id: &fleet_proto::NodeId,
        offer: ReleaseOffer,
    ) -> Result<UpdateSent, CoordinatorError> {
        let command = fleet_proto::protocol::Command::Update { release: offer };
        match self.call_node(node_id, "update", command).await? {
            fleet_proto::protocol::Reply::Updating { from, to } => Ok(UpdateSent {
                node_id: node_id.clone(),
                from,
                to,
            }),
            other => Err(refused(format!(
                "node {node_id} answered update with {other:?}; run an agent of this coordinator's version"
            ))),
        }
    }
}
