//! An OCI image layout on disk: `oci-layout`, `index.json` and `blobs/sha256/`, with verified reads and atomic writes.
use crate::digest::{Digest, DigestWriter, VerifyingReader};
use crate::spec::{self, ANNOTATION_REF_NAME, Descriptor, Index};
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
    #[error("cannot {action} {}: {source}", .path.display())]
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

/// Says what a path holds, or why it can never be a layout. Writes nothing.
pub fn probe(dir: &Path) -> Result<Probe> {
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

/// An exclusive advisory lock on a layout, held until dropped, so concurrent writers of one
/// `index.json` take turns instead of losing each other's refs.
#[derive(Debug)]
pub struct LayoutLock {
    _dir: File,
}

/// The most bytes read for one JSON document (manifest, index, config).
pub const JSON_LIMIT: u64 = 16 << 20;

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
        if probe(dir)? == Probe::Layout {
            return Layout::open(dir);
        }
        fs::create_dir_all(dir.join("blobs/sha256")).map_err(io_err("create", dir))?;
        let layout = Layout {
            dir: dir.to_path_buf(),
        };
        layout.write_index(&Index::empty())?;
        // oci-layout last: a directory is only taken for a layout once it is whole.
        write_atomic(&dir.join("oci-layout"), OCI_LAYOUT_FILE.as_bytes())?;
        Ok(layout)
    }

    /// The layout's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Takes the layout's writer lock (an `flock` on the directory; creates no file).
    pub fn lock(&self) -> Result<LayoutLock> {
        let dir = File::open(&self.dir).map_err(io_err("open", &self.dir))?;
        rustix::fs::flock(&dir, rustix::fs::FlockOperation::LockExclusive)
            .map_err(|e| io_err("lock", &self.dir)(e.into()))?;
        Ok(LayoutLock { _dir: dir })
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
        let dir = self.dir.join("blobs/sha256");
        let tmp = tempfile::Builder::new()
            .prefix(".tmp-")
            .permissions(readable_by_all())
            .tempfile_in(&dir)
            .map_err(io_err("create a temporary file in", &dir))?;
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

    /// Finds the descriptor of an image: a ref name in `index.json` (the last entry wins), or a
    /// digest in `index.json` or, failing that, any manifest or index blob of the layout.
    pub fn resolve(&self, image: &RefOrDigest) -> Result<Descriptor> {
        let index = self.index()?;
        match image {
            RefOrDigest::Name(name) => index
                .manifests
                .iter()
                .rev()
                .find(|d| d.ref_name() == Some(name))
                .cloned()
                .ok_or_else(|| LayoutError::RefNotFound {
                    dir: self.dir.clone(),
                    name: name.clone(),
                    known: index
                        .manifests
                        .iter()
                        .filter_map(|d| d.ref_name().map(str::to_string))
                        .collect(),
                }),
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
        validate_ref_name(name)?;
        let mut index = self.index()?;
        index.manifests.retain(|d| d.ref_name() != Some(name));
        let mut entry = descriptor.clone();
        entry
            .annotations
            .insert(ANNOTATION_REF_NAME.to_string(), name.to_string());
        index.manifests.push(entry);
        self.write_index(&index)
    }

    fn write_index(&self, index: &Index) -> Result<()> {
        write_atomic(&self.dir.join("index.json"), &spec::to_json_bytes(index))
    }
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
    inner: DigestWriter<BufWriter<tempfile::NamedTempFile>>,
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
            return Err(LayoutError::Mismatch(crate::digest::mismatch_message(
                "blob", expected, &digest, size,
            )));
        }
        tmp.as_file()
            .sync_all()
            .map_err(io_err("sync", tmp.path()))?;
        let path = self.layout.blob_path(&digest);
        let existed = path.exists();
        tmp.persist(&path)
            .map_err(|e| io_err("rename a blob to", &path)(e.error))?;
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
        let fd = std::os::fd::AsRawFd::as_raw_fd(self.inner.get_mut().get_ref().as_file());
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
/// was: the blobs it created and, for a layout it made, the layout itself. Dropped without
/// [`Rollback::keep`], it undoes.
#[derive(Debug)]
pub struct Rollback {
    dir: PathBuf,
    before: Probe,
    blobs: Vec<PathBuf>,
    keep: bool,
    /// Released only after the undo (fields drop after `Drop::drop`), so no other writer sees it half done.
    lock: Option<LayoutLock>,
}

impl Rollback {
    /// Starts tracking a layout that held `before` when the command started.
    pub fn new(dir: &Path, before: Probe) -> Rollback {
        Rollback {
            dir: dir.to_path_buf(),
            before,
            blobs: Vec::new(),
            keep: false,
            lock: None,
        }
    }

    /// Holds the layout's lock until the command is kept or undone.
    pub fn hold(&mut self, lock: LayoutLock) {
        self.lock = Some(lock);
    }

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
        if self.keep {
            return;
        }
        // Best effort: the command is already failing with its own error.
        for blob in &self.blobs {
            let _ = fs::remove_file(blob);
        }
        match self.before {
            Probe::Layout => {}
            Probe::Missing => {
                let _ = fs::remove_dir_all(&self.dir);
            }
            Probe::Empty => {
                for name in ["oci-layout", "index.json"] {
                    let _ = fs::remove_file(self.dir.join(name));
                }
                let _ = fs::remove_dir_all(self.dir.join("blobs"));
            }
        }
    }
}

/// Replaces a file atomically: a temporary file beside it, fsync, rename, fsync of the directory.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut tmp = tempfile::Builder::new()
        .prefix(".tmp-")
        .permissions(readable_by_all())
        .tempfile_in(dir)
        .map_err(io_err("create a temporary file in", dir))?;
    tmp.write_all(bytes).map_err(io_err("write", tmp.path()))?;
    tmp.as_file()
        .sync_all()
        .map_err(io_err("sync", tmp.path()))?;
    tmp.persist(path)
        .map_err(|e| io_err("replace", path)(e.error))?;
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
