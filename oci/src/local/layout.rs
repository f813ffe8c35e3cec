//! An OCI image layout on disk: `oci-layout`, `index.json` and `blobs/sha256/`, with verified reads and atomic writes.
use crate::local::cleanup;
use crate::types::digest::{Digest, DigestWriter, VerifyingReader};
use crate::types::spec::{self, ANNOTATION_REF_NAME, Descriptor, Index};
use std::fmt;
use std::fs::{self, File};
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

/// The contents of every `oci-layout` file this crate writes.
pub const OCI_LAYOUT_FILE: &str = r#"{"imageLayoutVersion":"1.0.0"}"#;

/// Everything that can go wrong with a layout. Messages name the path or value involved.
#[derive(Debug, thiserror::Error)]
pub enum LayoutError {
    /// The directory exists but holds no `oci-layout` file.
    #[error("{} is not an OCI image layout (no oci-layout file): pass a layout, or a new or empty directory", .0.display())]
    NotALayout(PathBuf),
    /// Nothing exists at the path.
    #[error("layout {} does not exist: pass the directory of an OCI image layout", .0.display())]
    Missing(PathBuf),
    /// The path exists and is not a directory.
    #[error("{} is not a directory: pass an OCI image layout directory", .0.display())]
    NotADirectory(PathBuf),
    /// A layout file holds JSON this crate cannot read.
    #[error("{} is not valid: {msg}", .path.display())]
    Corrupt { path: PathBuf, msg: String },
    /// Entries of `index.json` with this ref name point at different images.
    #[error("ref {name:?} is ambiguous in {}: it names {}; pick one by its digest instead of the name", .dir.display(), .digests.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(" and "))]
    Ambiguous {
        dir: PathBuf,
        name: String,
        digests: Vec<Digest>,
    },
    /// No entry of `index.json` carries this ref name.
    #[error("no image {name:?} in {}: {}", .dir.display(), list_refs(.known))]
    RefNotFound {
        dir: PathBuf,
        name: String,
        known: Vec<String>,
    },
    /// The layout has no blob with this digest.
    #[error("no blob {digest} in {}", .dir.display())]
    BlobNotFound { dir: PathBuf, digest: Digest },
    /// A ref name does not follow the image-spec grammar.
    #[error("bad ref {0:?}: use letters and digits, separated by one of . _ - : @ + or /")]
    BadRefName(String),
    /// A blob's bytes do not hash to its name (or are not the size its descriptor says).
    #[error("{0}")]
    Mismatch(String),
    /// A blob meant to be a JSON document is larger than any sane one.
    #[error("blob {digest} in {} is {size} bytes, more than the {limit} allowed for a JSON document", .dir.display())]
    TooLarge {
        dir: PathBuf,
        digest: Digest,
        size: u64,
        limit: u64,
    },
    /// An I/O error on a path.
    #[error("cannot {action} {}: {}", .path.display(), crate::io_detail(.source))]
    Io {
        action: &'static str,
        path: PathBuf,
        source: io::Error,
    },
}

fn list_refs(names: &[String]) -> String {
    if names.is_empty() {
        "the layout has no named images".to_string()
    } else {
        format!("it has {}", names.join(", "))
    }
}

type Result<T> = std::result::Result<T, LayoutError>;

fn io_err<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> LayoutError + 'a {
    move |source| LayoutError::Io {
        action,
        path: path.to_path_buf(),
        source,
    }
}

/// What a path holds, before anything is written there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// Nothing exists at the path.
    Missing,
    /// An empty directory.
    Empty,
    /// A directory with an `oci-layout` file.
    Layout,
}

/// Says what a path holds, or why it can never be a layout. Writes nothing. A directory that looks
/// half made waits for the command making (or taking back) a layout there, then is looked at again.
pub fn probe(dir: &Path) -> Result<Probe> {
    loop {
        match probe_now(dir) {
            Err(LayoutError::NotALayout(_)) => {
                // Another command holds the layout's lock while it makes one here or takes one back.
                let Ok(held) = File::open(dir) else { continue };
                rustix::fs::flock(&held, rustix::fs::FlockOperation::LockShared)
                    .map_err(|e| io_err("lock", dir)(e.into()))?;
                // Unless the directory waited on was taken back, what is there now is whole.
                if same_file(&held, dir) {
                    return probe_now(dir);
                }
            }
            other => return other,
        }
    }
}

/// Whether an open file is still the one at `path`.
fn same_file(file: &File, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (file.metadata(), fs::symlink_metadata(path)) {
        (Ok(a), Ok(b)) => (a.dev(), a.ino()) == (b.dev(), b.ino()),
        _ => false,
    }
}

fn probe_now(dir: &Path) -> Result<Probe> {
    match fs::symlink_metadata(dir) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Probe::Missing),
        Err(e) => Err(io_err("read", dir)(e)),
        Ok(m) if !fs::metadata(dir).map(|m| m.is_dir()).unwrap_or(m.is_dir()) => {
            Err(LayoutError::NotADirectory(dir.to_path_buf()))
        }
        Ok(_) => {
            if dir.join("oci-layout").exists() {
                Ok(Probe::Layout)
            } else if fs::read_dir(dir)
                .map_err(io_err("read", dir))?
                .next()
                .is_none()
            {
                Ok(Probe::Empty)
            } else {
                Err(LayoutError::NotALayout(dir.to_path_buf()))
            }
        }
    }
}

/// Whether a string is a valid `org.opencontainers.image.ref.name`:
/// components of `[A-Za-z0-9]+` joined by `-._:@+` (or `--`) within a component, and `/` between components.
pub fn validate_ref_name(name: &str) -> Result<()> {
    let bad = || LayoutError::BadRefName(name.to_string());
    for component in name.split('/') {
        let bytes = component.as_bytes();
        if bytes.is_empty()
            || !bytes[0].is_ascii_alphanumeric()
            || !bytes[bytes.len() - 1].is_ascii_alphanumeric()
        {
            return Err(bad());
        }
        let mut run = 0;
        for &b in bytes {
            if b.is_ascii_alphanumeric() {
                run = 0;
            } else if b"-._:@+".contains(&b) {
                run += 1;
                // Only "--" may repeat a separator.
                if run > 2 || (run == 2 && b != b'-') {
                    return Err(bad());
                }
            } else {
                return Err(bad());
            }
        }
    }
    Ok(())
}

/// Which image of a layout: by ref name or by digest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RefOrDigest {
    /// An `org.opencontainers.image.ref.name` in `index.json`.
    Name(String),
    /// A manifest or index digest (in `index.json`, or any blob of the layout).
    Digest(Digest),
}

impl fmt::Display for RefOrDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RefOrDigest::Name(n) => f.write_str(n),
            RefOrDigest::Digest(d) => write!(f, "{d}"),
        }
    }
}

impl RefOrDigest {
    /// A ref name (validated) or, when it starts with `sha256:`, a digest.
    pub fn parse(s: &str) -> Result<RefOrDigest> {
        if s.starts_with("sha256:") {
            return Digest::parse(s)
                .map(RefOrDigest::Digest)
                .map_err(|_| LayoutError::BadRefName(s.to_string()));
        }
        validate_ref_name(s)?;
        Ok(RefOrDigest::Name(s.to_string()))
    }
}

/// An opened OCI image layout.
#[derive(Debug, Clone)]
pub struct Layout {
    dir: PathBuf,
}

/// The writer lock of a layout: an exclusive `flock` on its directory, held until dropped, so
/// writers of one layout take turns and none loses another's refs or blobs.
#[derive(Debug)]
pub struct LayoutLock {
    dir: File,
}

impl LayoutLock {
    fn take(dir: &Path) -> Result<LayoutLock> {
        let file = File::open(dir).map_err(io_err("open", dir))?;
        rustix::fs::flock(&file, rustix::fs::FlockOperation::LockExclusive)
            .map_err(|e| io_err("lock", dir)(e.into()))?;
        Ok(LayoutLock { dir: file })
    }

    /// Whether the locked directory is still the one at `dir` (a command that failed while this
    /// one waited may have removed the layout it had made).
    fn still_at(&self, dir: &Path) -> bool {
        same_file(&self.dir, dir)
    }
}

/// The most bytes read for one JSON document (manifest, index, config).
pub const JSON_LIMIT: u64 = 16 << 20;

/// How every temporary file of a layout starts; one whose owner is gone is removed by the next writer.
pub const TEMP_PREFIX: &str = ".tmp-";

impl Layout {
    /// Opens an existing layout: the directory must hold an `oci-layout` file.
    pub fn open(dir: &Path) -> Result<Layout> {
        match probe(dir)? {
            Probe::Layout => Ok(Layout {
                dir: dir.to_path_buf(),
            }),
            Probe::Missing => Err(LayoutError::Missing(dir.to_path_buf())),
            Probe::Empty => Err(LayoutError::NotALayout(dir.to_path_buf())),
        }
    }

    /// Opens a layout, or makes one in a new or empty directory (`oci-layout`, empty `index.json`, `blobs/sha256`).
    pub fn create(dir: &Path) -> Result<Layout> {
        let (layout, rollback) = Layout::create_locked(dir)?;
        rollback.keep();
        Ok(layout)
    }

    /// Opens a layout for writing, making it in a new or empty directory, and takes its writer lock.
    /// What a command that died left there is swept. The [`Rollback`] holds the lock; dropped
    /// without [`Rollback::keep`], it takes back what the command added, the layout too if it made it.
    pub fn create_locked(dir: &Path) -> Result<(Layout, Rollback)> {
        loop {
            let made_dir = match fs::create_dir(dir) {
                Ok(()) => true,
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => false,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    let parent = dir.parent().unwrap_or(Path::new("."));
                    fs::create_dir_all(parent).map_err(io_err("create", parent))?;
                    continue;
                }
                Err(e) => return Err(io_err("create", dir)(e)),
            };
            let lock = LayoutLock::take(dir)?;
            if !lock.still_at(dir) {
                continue;
            }
            let layout = Layout {
                dir: dir.to_path_buf(),
            };
            let created = match probe_now(dir)? {
                Probe::Layout => None,
                Probe::Empty => Some(made_dir),
                Probe::Missing => continue,
            };
            let rollback = Rollback {
                dir: dir.to_path_buf(),
                created,
                blobs: Vec::new(),
                keep: false,
                _lock: lock,
            };
            if let Some(made_dir) = created {
                cleanup::registry().add_layout(dir, made_dir);
                fs::create_dir_all(dir.join("blobs/sha256")).map_err(io_err("create", dir))?;
                layout.write_index(&Index::empty())?;
                // oci-layout last: a directory is only taken for a layout once it is whole.
                write_atomic(&dir.join("oci-layout"), OCI_LAYOUT_FILE.as_bytes())?;
            }
            layout.sweep();
            return Ok((layout, rollback));
        }
    }

    /// Takes the writer lock of this existing layout and sweeps what a command that died left.
    pub fn lock(&self) -> Result<Rollback> {
        let lock = LayoutLock::take(&self.dir)?;
        if !lock.still_at(&self.dir) {
            return Err(LayoutError::Missing(self.dir.clone()));
        }
        self.sweep();
        Ok(Rollback {
            dir: self.dir.clone(),
            created: None,
            blobs: Vec::new(),
            keep: false,
            _lock: lock,
        })
    }

    /// Removes the temporary files whose owner is gone: a live owner holds a lock on its file.
    /// Best effort: a file that cannot be removed now is tried again by the next writer.
    fn sweep(&self) {
        for dir in [self.dir.clone(), self.dir.join("blobs/sha256")] {
            for entry in fs::read_dir(&dir).into_iter().flatten().flatten() {
                let path = entry.path();
                if !entry
                    .file_name()
                    .as_encoded_bytes()
                    .starts_with(TEMP_PREFIX.as_bytes())
                {
                    continue;
                }
                let Ok(file) = File::open(&path) else {
                    continue;
                };
                let unowned =
                    rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive)
                        .is_ok();
                // Still under that name (not just renamed to a blob by an owner that finished).
                if unowned && same_file(&file, &path) {
                    let _ = fs::remove_file(&path);
                }
            }
        }
    }

    /// The layout's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where a blob lives (whether or not it exists).
    pub fn blob_path(&self, digest: &Digest) -> PathBuf {
        self.dir.join("blobs/sha256").join(digest.hex())
    }

    /// Whether the layout has a blob with this digest (its bytes are not checked here).
    pub fn has_blob(&self, digest: &Digest) -> bool {
        self.blob_path(digest).is_file()
    }

    /// Opens a blob for reading; the reader fails at its end if the bytes do not match the digest
    /// (or `size`, when given).
    pub fn open_blob(
        &self,
        digest: &Digest,
        size: Option<u64>,
    ) -> Result<VerifyingReader<BufReader<File>>> {
        let path = self.blob_path(digest);
        let file = File::open(&path).map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => LayoutError::BlobNotFound {
                dir: self.dir.clone(),
                digest: *digest,
            },
            _ => io_err("open", &path)(e),
        })?;
        Ok(VerifyingReader::new(
            BufReader::with_capacity(1 << 20, file),
            *digest,
            size,
            "blob",
        ))
    }

    /// Reads a whole small blob (a JSON document), verified against its digest and size.
    pub fn read_blob(&self, digest: &Digest, size: Option<u64>) -> Result<Vec<u8>> {
        let path = self.blob_path(digest);
        let mut reader = self.open_blob(digest, size)?;
        let len = fs::metadata(&path).map_err(io_err("read", &path))?.len();
        if len > JSON_LIMIT {
            return Err(LayoutError::TooLarge {
                dir: self.dir.clone(),
                digest: *digest,
                size: len,
                limit: JSON_LIMIT,
            });
        }
        let mut bytes = Vec::with_capacity(len as usize);
        reader
            .read_to_end(&mut bytes)
            .map_err(|e| self.read_error(e, &path))?;
        Ok(bytes)
    }

    /// Reads a blob to its end without keeping it, to check its bytes against its digest.
    pub fn verify_blob(&self, digest: &Digest, size: Option<u64>) -> Result<()> {
        let mut reader = self.open_blob(digest, size)?;
        io::copy(&mut reader, &mut io::sink())
            .map_err(|e| self.read_error(e, &self.blob_path(digest)))?;
        Ok(())
    }

    /// Turns a read error into a layout error, keeping a digest mismatch as one clear line.
    pub fn read_error(&self, e: io::Error, path: &Path) -> LayoutError {
        if e.kind() == io::ErrorKind::InvalidData {
            LayoutError::Mismatch(format!("{e} (in {})", self.dir.display()))
        } else {
            io_err("read", path)(e)
        }
    }

    /// Starts writing a blob: bytes go to a temporary file inside the layout until `commit`.
    pub fn blob_writer(&self) -> Result<BlobWriter> {
        let tmp = Temp::new(&self.dir.join("blobs/sha256"))?;
        Ok(BlobWriter {
            layout: self.clone(),
            inner: DigestWriter::new(BufWriter::with_capacity(1 << 20, tmp)),
            kicked: 0,
        })
    }

    /// Writes a whole blob from memory; returns its digest, size and whether it is new to the layout.
    pub fn write_blob(&self, bytes: &[u8]) -> Result<Committed> {
        let mut w = self.blob_writer()?;
        w.write_all(bytes).map_err(io_err("write", &self.dir))?;
        w.commit(None)
    }

    /// Copies a blob from another layout, checking its bytes on the way; a blob already here is
    /// only verified.
    pub fn copy_blob_from(
        &self,
        from: &Layout,
        digest: &Digest,
        size: Option<u64>,
    ) -> Result<Committed> {
        if from.dir == self.dir || self.has_blob(digest) {
            from.verify_blob(digest, size)?;
            if from.dir != self.dir {
                self.verify_blob(digest, size)?;
            }
            return Ok(Committed {
                digest: *digest,
                size: size.unwrap_or(0),
                new_path: None,
            });
        }
        let mut reader = from.open_blob(digest, size)?;
        let mut w = self.blob_writer()?;
        io::copy(&mut reader, &mut w).map_err(|e| from.read_error(e, &from.blob_path(digest)))?;
        w.commit(Some(digest))
    }

    /// Reads `index.json`.
    pub fn index(&self) -> Result<Index> {
        let path = self.dir.join("index.json");
        let bytes = fs::read(&path).map_err(io_err("read", &path))?;
        serde_json::from_slice(&bytes).map_err(|e| LayoutError::Corrupt {
            path,
            msg: e.to_string(),
        })
    }

    /// The ref names in `index.json`, in its order.
    pub fn ref_names(&self) -> Result<Vec<String>> {
        Ok(self
            .index()?
            .manifests
            .iter()
            .filter_map(|d| d.ref_name().map(str::to_string))
            .collect())
    }

    /// Finds the descriptor of an image: a ref name in `index.json` (a name that points at two
    /// different images is refused), or a digest in `index.json` or, failing that, any manifest or
    /// index blob of the layout.
    pub fn resolve(&self, image: &RefOrDigest) -> Result<Descriptor> {
        let index = self.index()?;
        match image {
            RefOrDigest::Name(name) => {
                let named: Vec<&Descriptor> = index
                    .manifests
                    .iter()
                    .filter(|d| d.ref_name() == Some(name))
                    .collect();
                let mut digests: Vec<Digest> = Vec::new();
                for d in &named {
                    if !digests.contains(&d.digest) {
                        digests.push(d.digest);
                    }
                }
                match named.first() {
                    None => Err(LayoutError::RefNotFound {
                        dir: self.dir.clone(),
                        name: name.clone(),
                        known: index
                            .manifests
                            .iter()
                            .filter_map(|d| d.ref_name().map(str::to_string))
                            .collect(),
                    }),
                    Some(_) if digests.len() > 1 => Err(LayoutError::Ambiguous {
                        dir: self.dir.clone(),
                        name: name.clone(),
                        digests,
                    }),
                    Some(d) => Ok((*d).clone()),
                }
            }
            RefOrDigest::Digest(digest) => {
                if let Some(d) = index.manifests.iter().find(|d| d.digest == *digest) {
                    return Ok(d.clone());
                }
                let bytes = self.read_blob(digest, None)?;
                let media_type = sniff_media_type(&bytes).ok_or_else(|| LayoutError::Corrupt {
                    path: self.blob_path(digest),
                    msg:
                        "it is not a manifest or an index (no mediaType, manifests or layers field)"
                            .to_string(),
                })?;
                Ok(Descriptor::new(&media_type, *digest, bytes.len() as u64))
            }
        }
    }

    /// Points `name` at `descriptor` in `index.json`, replacing any entry of that name and leaving
    /// the others alone. The file is replaced atomically.
    pub fn set_ref(&self, name: &str, descriptor: &Descriptor) -> Result<()> {
        self.set_ref_with_untagged(name, descriptor, &[])
    }

    /// [`Layout::set_ref`] and [`Layout::add_untagged`] of each of `untagged` in one replacement
    /// of `index.json`: all land or none does.
    pub fn set_ref_with_untagged(
        &self,
        name: &str,
        descriptor: &Descriptor,
        untagged: &[Descriptor],
    ) -> Result<()> {
        validate_ref_name(name)?;
        let mut index = self.index()?;
        index.manifests.retain(|d| d.ref_name() != Some(name));
        let mut entry = descriptor.clone();
        entry
            .annotations
            .insert(ANNOTATION_REF_NAME.to_string(), name.to_string());
        index.manifests.push(entry);
        for d in untagged {
            push_untagged(&mut index, d);
        }
        self.write_index(&index)
    }

    /// Adds `descriptor` to `index.json` without a ref name (a referrer of an image, found by its
    /// `subject`), unless an entry of that digest without a ref name is there already.
    pub fn add_untagged(&self, descriptor: &Descriptor) -> Result<()> {
        let mut index = self.index()?;
        if push_untagged(&mut index, descriptor) {
            self.write_index(&index)
        } else {
            Ok(())
        }
    }

    fn write_index(&self, index: &Index) -> Result<()> {
        write_atomic(&self.dir.join("index.json"), &spec::to_json_bytes(index))
    }
}

/// Adds `descriptor` without a ref name unless an entry of that digest without one is there;
/// says whether it added it.
fn push_untagged(index: &mut Index, descriptor: &Descriptor) -> bool {
    if index
        .manifests
        .iter()
        .any(|d| d.digest == descriptor.digest && d.ref_name().is_none())
    {
        return false;
    }
    let mut entry = descriptor.clone();
    entry.annotations.remove(ANNOTATION_REF_NAME);
    index.manifests.push(entry);
    true
}

/// A manifest's or index's media type from its own bytes (for documents found only by digest).
pub fn sniff_media_type(bytes: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(bytes).ok()?;
    if let Some(m) = v.get("mediaType").and_then(|m| m.as_str()) {
        return Some(m.to_string());
    }
    if v.get("manifests").is_some() {
        Some(spec::MEDIA_TYPE_INDEX.to_string())
    } else if v.get("layers").is_some() {
        Some(spec::MEDIA_TYPE_MANIFEST.to_string())
    } else {
        None
    }
}

/// A blob on its way into a layout. Dropped without `commit`, its temporary file is removed.
pub struct BlobWriter {
    layout: Layout,
    inner: DigestWriter<BufWriter<Temp>>,
    /// Bytes already handed to the kernel's writeback.
    kicked: u64,
}

/// How many written bytes may wait before writeback is started on them, so the final fsync of a
/// large blob finds little left to do and dirty memory stays small.
const WRITEBACK_EVERY: u64 = 8 << 20;

/// A blob that is now in the layout.
#[derive(Debug, Clone)]
pub struct Committed {
    /// Its digest.
    pub digest: Digest,
    /// Its size in bytes.
    pub size: u64,
    /// Its path, when this commit created it (so a failed build can take it back).
    pub new_path: Option<PathBuf>,
}

impl BlobWriter {
    /// Bytes written so far.
    pub fn len(&self) -> u64 {
        self.inner.len()
    }

    /// Whether nothing was written yet.
    pub fn is_empty(&self) -> bool {
        self.inner.is_empty()
    }

    /// Flushes, fsyncs and renames the blob to its digest's name (then fsyncs the directory).
    /// With `expected`, bytes that do not hash to it are refused and nothing is stored.
    pub fn commit(self, expected: Option<&Digest>) -> Result<Committed> {
        let dir = self.layout.dir.join("blobs/sha256");
        let (buffered, digest, size) = self.inner.finish();
        let tmp = buffered
            .into_inner()
            .map_err(|e| io_err("write", &dir)(e.into_error()))?;
        if let Some(expected) = expected
            && *expected != digest
        {
            return Err(LayoutError::Mismatch(
                crate::types::digest::mismatch_message("blob", expected, &digest, size),
            ));
        }
        tmp.file().sync_all().map_err(io_err("sync", tmp.path()))?;
        let path = self.layout.blob_path(&digest);
        let existed = path.exists();
        tmp.persist(&path)
            .map_err(io_err("rename a blob to", &path))?;
        sync_dir(&dir)?;
        Ok(Committed {
            digest,
            size,
            new_path: (!existed).then_some(path),
        })
    }
}

impl BlobWriter {
    /// Starts writeback of what was written since the last call (it does not wait for it).
    fn kick_writeback(&mut self) -> io::Result<()> {
        let buffered = self.inner.get_mut();
        buffered.flush()?;
        let (from, len) = (self.kicked, self.inner.len() - self.kicked);
        let fd = std::os::fd::AsRawFd::as_raw_fd(self.inner.get_mut().get_ref().file());
        // SAFETY: a plain syscall on a file descriptor we own; it only reads its arguments.
        let rc = unsafe {
            libc::sync_file_range(fd, from as i64, len as i64, libc::SYNC_FILE_RANGE_WRITE)
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        self.kicked += len;
        Ok(())
    }
}

impl Write for BlobWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        if self.inner.len() - self.kicked >= WRITEBACK_EVERY {
            self.kick_writeback()?;
        }
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Takes back what a failed command added to a layout, so that the layout is left exactly as it
/// was: the blobs it created and, for a layout it made, the layout itself. It holds the layout's
/// writer lock. Dropped without [`Rollback::keep`], it undoes.
#[derive(Debug)]
pub struct Rollback {
    dir: PathBuf,
    /// `Some(made_dir)` when this command made the layout (in a directory it made, or an empty one).
    created: Option<bool>,
    blobs: Vec<PathBuf>,
    keep: bool,
    /// Released only after the undo (fields drop after `Drop::drop`), so no other writer sees it half done.
    _lock: LayoutLock,
}

impl Rollback {
    /// Remembers a committed blob, to remove it if the command fails.
    pub fn track(&mut self, committed: &Committed) {
        if let Some(p) = &committed.new_path {
            self.blobs.push(p.clone());
        }
    }

    /// The command succeeded: keep everything.
    pub fn keep(mut self) {
        self.keep = true;
    }
}

impl Drop for Rollback {
    fn drop(&mut self) {
        if !self.keep {
            // Best effort: the command is already failing with its own error.
            for blob in &self.blobs {
                let _ = fs::remove_file(blob);
            }
            if let Some(made_dir) = self.created {
                cleanup::remove_layout(&self.dir, made_dir);
            }
        }
        if self.created.is_some() {
            cleanup::registry().remove_layout(&self.dir);
        }
    }
}

/// A temporary file in a layout (`.tmp-*`), locked by its owner for as long as it lives and known
/// to [`cleanup`], so neither an interrupt nor a crash leaves it behind for good.
struct Temp(Option<tempfile::NamedTempFile>);

impl Temp {
    fn new(dir: &Path) -> Result<Temp> {
        loop {
            let tmp = {
                let mut registry = cleanup::registry();
                let tmp = tempfile::Builder::new()
                    .prefix(TEMP_PREFIX)
                    .permissions(readable_by_all())
                    .tempfile_in(dir)
                    .map_err(io_err("create a temporary file in", dir))?;
                registry.add_temp(tmp.path());
                Temp(Some(tmp))
            };
            rustix::fs::flock(tmp.file(), rustix::fs::FlockOperation::LockExclusive)
                .map_err(|e| io_err("lock", tmp.path())(e.into()))?;
            // A writer sweeping the layout may have locked and removed it first: make another.
            let linked = tmp.file().metadata().map(|m| {
                use std::os::unix::fs::MetadataExt;
                m.nlink() > 0
            });
            if linked.map_err(io_err("read", tmp.path()))? {
                return Ok(tmp);
            }
        }
    }

    fn inner(&self) -> &tempfile::NamedTempFile {
        self.0
            .as_ref()
            // Cannot fail: only `persist` takes the file, and it consumes the writer.
            .expect("a temporary file is only taken by persist")
    }

    fn file(&self) -> &File {
        self.inner().as_file()
    }

    fn path(&self) -> &Path {
        self.inner().path()
    }

    /// Renames it to `path` (replacing what is there).
    fn persist(mut self, path: &Path) -> io::Result<()> {
        // Cannot fail: `persist` consumes the writer, so it runs once.
        let tmp = self.0.take().expect("persisted once");
        let mut registry = cleanup::registry();
        registry.remove_temp(tmp.path());
        tmp.persist(path).map(drop).map_err(|e| e.error)
    }
}

impl Write for Temp {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        // Cannot fail: a persisted writer is consumed and cannot be written to.
        self.0.as_mut().expect("not persisted").write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        // Cannot fail: a persisted writer is consumed and cannot be flushed.
        self.0.as_mut().expect("not persisted").flush()
    }
}

impl Drop for Temp {
    fn drop(&mut self) {
        if let Some(tmp) = self.0.take() {
            let mut registry = cleanup::registry();
            registry.remove_temp(tmp.path());
            drop(tmp);
        }
    }
}

/// Replaces a file atomically: a temporary file beside it, fsync, rename, fsync of the directory.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut tmp = Temp::new(dir)?;
    tmp.write_all(bytes).map_err(io_err("write", tmp.path()))?;
    tmp.file().sync_all().map_err(io_err("sync", tmp.path()))?;
    tmp.persist(path).map_err(io_err("replace", path))?;
    sync_dir(dir)
}

/// Layout files are 0644 less the umask, as other tools write them, so a registry or web server
/// running as another user can serve the layout (temporary files default to 0600).
fn readable_by_all() -> std::fs::Permissions {
    use std::os::unix::fs::PermissionsExt;
    std::fs::Permissions::from_mode(0o644)
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err("sync", dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ref_names_follow_the_image_spec_grammar() {
        for good in ["app", "v1.0", "a/b", "app:1", "x--y", "a@b+c", "Latest_1"] {
            validate_ref_name(good).unwrap();
        }
        for bad in [
            "", "-a", "a-", "a..b", "a b", "a//b", "/a", "a/", "é", "a---b",
        ] {
            assert!(validate_ref_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn blobs_round_trip_and_refs_replace() {
        let tmp = tempfile::tempdir().unwrap();
        let layout = Layout::create(&tmp.path().join("l")).unwrap();
        let c = layout.write_blob(b"{}").unwrap();
        assert!(c.new_path.is_some());
        assert_eq!(layout.read_blob(&c.digest, Some(2)).unwrap(), b"{}");
        assert!(layout.write_blob(b"{}").unwrap().new_path.is_none());
        let d = Descriptor::new(spec::MEDIA_TYPE_MANIFEST, c.digest, c.size);
        layout.set_ref("a", &d).unwrap();
        layout.set_ref("b", &d).unwrap();
        layout.set_ref("a", &d).unwrap();
        assert_eq!(layout.ref_names().unwrap(), ["b", "a"]);
        assert_eq!(
            layout
                .resolve(&RefOrDigest::Name("a".into()))
                .unwrap()
                .digest,
            c.digest
        );
        let e = layout.resolve(&RefOrDigest::Name("c".into())).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("no image \"c\" in {}: it has b, a", layout.dir().display())
        );
        fs::write(layout.blob_path(&c.digest), b"[]").unwrap();
        let e = layout.read_blob(&c.digest, None).unwrap_err();
        assert!(e.to_string().contains("does not match its digest"), "{e}");
    }
}
