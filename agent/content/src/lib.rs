//! Content by digest, for the agent and the coordinator alike: the folder of content-addressed
//! blobs both keep, and the streaming, hashing copy every transfer goes through (the one landing
//! that hashes, checks, resumes and renames into place). Memory stays flat with the content's
//! size: one buffer of [`CHUNK`] bytes per transfer. `files` holds the crash-safe writes of small
//! files both sides use for keys and identities.
pub mod direct;
pub mod files;
pub mod landing;

pub use landing::{Landing, Place, Stopped};

use fleet_vocab::{Digest, UploadId};
use sha2::{Digest as _, Sha256};
use std::fs::{self, File};
use std::future::Future;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The buffer each transfer moves bytes through.
pub const CHUNK: usize = 256 << 10;

static TEMPS: AtomicU64 = AtomicU64::new(0);

/// Why content could not be moved or used; every message names the content (its digest, or an
/// upload's file before it is hashed) and what to do.
#[derive(Debug, thiserror::Error)]
pub enum ContentError {
    #[error(
        "content {digest}: the bytes received hash to {got}; removed them, so the next try fetches it whole (check the sender's copy)"
    )]
    Mismatch { digest: Digest, got: Digest },
    #[error(
        "content {digest}: the disk holding {} is full ({cause}); removed the partial content, free space there and run it again", dir.display()
    )]
    NoSpace {
        digest: Digest,
        dir: PathBuf,
        cause: io::Error,
    },
    #[error(
        "content {content}: the transfer stopped after {got} of {size} bytes ({cause}); the next try resumes from there"
    )]
    Cut {
        /// The content's digest, or for an upload not hashed yet, its file.
        content: String,
        got: u64,
        size: u64,
        cause: String,
    },
    #[error("content {content}: {reason}")]
    Failed { content: String, reason: String },
}

impl ContentError {
    /// Whether trying again may help (a cut connection), rather than repeat the same failure.
    pub fn is_retryable(&self) -> bool {
        matches!(self, ContentError::Cut { .. })
    }
}

/// Content-addressed files under one folder: `sha256/HEX` when whole and checked, `partial/HEX`
/// while a fetch is under way (kept across cuts, so a fetch resumes), `collected/NAME.partial`
/// while a collect's upload is under way (likewise) and `collected/NAME` once it is checked,
/// until the CLI moves it to `--out`; `tmp/` for imports.
#[derive(Debug, Clone)]
pub struct Blobs {
    root: PathBuf,
}

impl Blobs {
    pub fn new(root: impl Into<PathBuf>) -> Blobs {
        Blobs { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where the whole, checked content of `digest` lives.
    pub fn path(&self, digest: &Digest) -> PathBuf {
        self.root.join("sha256").join(digest.hex())
    }

    pub fn has(&self, digest: &Digest) -> bool {
        self.path(digest).is_file()
    }

    /// Where a fetch of `digest` keeps what arrived so far.
    pub fn partial(&self, digest: &Digest) -> PathBuf {
        self.root.join("partial").join(digest.hex())
    }

    /// Where the checked upload of the collect named `upload` waits for the CLI.
    pub fn collected(&self, upload: &UploadId) -> PathBuf {
        self.root.join("collected").join(upload.as_str())
    }

    /// Where the upload of the collect named `upload` keeps what arrived so far.
    pub fn collected_partial(&self, upload: &UploadId) -> PathBuf {
        self.root
            .join("collected")
            .join(format!("{upload}.partial"))
    }

    /// A fresh temporary file name in this store.
    pub fn temp(&self) -> io::Result<PathBuf> {
        let dir = self.root.join("tmp");
        fs::create_dir_all(&dir)?;
        let n = TEMPS.fetch_add(1, Ordering::Relaxed);
        Ok(dir.join(format!("{}-{n}", std::process::id())))
    }

    /// Every whole blob's digest, with its file's age.
    pub fn list(&self) -> io::Result<Vec<(Digest, std::time::Duration)>> {
        let dir = self.root.join("sha256");
        let entries = match fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        let mut out = Vec::new();
        for entry in entries {
            let entry = entry?;
            let Some(name) = entry.file_name().to_str().map(|n| format!("sha256:{n}")) else {
                continue;
            };
            let Ok(digest) = Digest::parse(&name) else {
                continue;
            };
            let age = entry.metadata()?.modified()?.elapsed().unwrap_or_default();
            out.push((digest, age));
        }
        Ok(out)
    }

    /// Puts a file checked against `digest` and synced (as [`direct::DirectWriter::finish`]
    /// leaves it) in place for good (rename, fsync of the folder): as that blob, or as a
    /// collect's upload for the CLI; returns where it is.
    pub fn place(&self, file: &Path, digest: &Digest, place: &Place) -> io::Result<PathBuf> {
        let dest = match place {
            Place::Blob => self.path(digest),
            Place::Collected(upload) => self.collected(upload),
        };
        settle(file, &dest)?;
        Ok(dest)
    }

    /// Removes what transfers left behind and nobody finished (partial fetches and uploads,
    /// uploads never taken, temporary files) once untouched for `grace`; returns them.
    pub fn remove_stale(&self, grace: std::time::Duration) -> io::Result<Vec<PathBuf>> {
        let mut removed = Vec::new();
        for folder in ["partial", "collected", "tmp"] {
            let entries = match fs::read_dir(self.root.join(folder)) {
                Ok(e) => e,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            };
            for entry in entries {
                let path = entry?.path();
                let Ok(age) = fs::metadata(&path).and_then(|m| m.modified()) else {
                    continue;
                };
                if age.elapsed().unwrap_or_default() >= grace && fs::remove_file(&path).is_ok() {
                    removed.push(path);
                }
            }
        }
        Ok(removed)
    }

    /// Streams a file into the store (hashing as it reads) and returns its digest and size.
    pub fn import(&self, source: &Path) -> io::Result<(Digest, u64)> {
        self.import_from(&mut File::open(source)?)
    }

    /// Streams what `reader` gives into the store (hashing as it reads) and returns its digest
    /// and size; nothing is left behind when it fails.
    pub fn import_from(&self, reader: &mut (impl Read + ?Sized)) -> io::Result<(Digest, u64)> {
        self.import_passing(reader, |_| {})
    }

    /// [`Blobs::import_from`], handing each piece to `pass` as it is written (a copy sent
    /// elsewhere while it is imported).
    pub fn import_passing(
        &self,
        reader: &mut (impl Read + ?Sized),
        pass: impl FnMut(&[u8]),
    ) -> io::Result<(Digest, u64)> {
        let temp = self.temp()?;
        let result = (|| {
            let file = direct::DirectWriter::create(&temp)?;
            let mut out = Passing { to: file, pass };
            let (digest, size) = copy_hashing(reader, &mut out)?;
            out.to.finish()?;
            self.place(&temp, &digest, &Place::Blob)?;
            Ok((digest, size))
        })();
        if result.is_err() {
            let _ = fs::remove_file(&temp);
        }
        result
    }

    /// Moves the checked upload of the collect named `upload` to `out`, atomically: renamed
    /// when both are on one filesystem (no pass over the bytes: they were checked against
    /// `digest` as they arrived, into a file no one else writes), else copied beside `out`,
    /// synced and renamed. On any failure nothing is left at `out`.
    pub fn take_collected(
        &self,
        upload: &UploadId,
        digest: &Digest,
        out: &Path,
    ) -> Result<(), ContentError> {
        let failed = |e: io::Error| ContentError::Failed {
            content: digest.to_string(),
            reason: format!("cannot write {} ({e})", out.display()),
        };
        let from = self.collected(upload);
        let dir = match out.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        match fs::rename(&from, out) {
            Ok(()) => return File::open(dir).and_then(|d| d.sync_all()).map_err(failed),
            Err(e) if e.raw_os_error() == Some(EXDEV) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound && !from.exists() => {
                return Err(ContentError::Failed {
                    content: digest.to_string(),
                    reason: "the coordinator holds no upload of it any more; collect it again"
                        .into(),
                });
            }
            Err(e) => return Err(failed(e)),
        }
        let name = out.file_name().and_then(|n| n.to_str()).unwrap_or("out");
        let temp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
        let result = fs::copy(&from, &temp)
            .and_then(|_| File::open(&temp)?.sync_all())
            .and_then(|()| settle(&temp, out));
        if result.is_err() {
            let _ = fs::remove_file(&temp);
        }
        result.map_err(failed)?;
        let _ = fs::remove_file(&from);
        Ok(())
    }
}

/// A writer that hands each piece it wrote to `pass` as well.
struct Passing<W, F> {
    to: W,
    pass: F,
}

impl<W: Write, F: FnMut(&[u8])> Write for Passing<W, F> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.to.write(buf)?;
        (self.pass)(&buf[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.to.flush()
    }
}

/// `rename(2)` across filesystems.
const EXDEV: i32 = 18;

/// Puts a synced file in place for good: rename to `dest`, fsync of its folder. Its own fsync is
/// its writer's: a second one here would cost one more disk flush per landing.
fn settle(file: &Path, dest: &Path) -> io::Result<()> {
    let dir = match dest.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    fs::create_dir_all(dir)?;
    fs::rename(file, dest)?;
    File::open(dir)?.sync_all()
}

/// Copies everything, hashing it, through one buffer.
pub fn copy_hashing(
    reader: &mut (impl Read + ?Sized),
    out: &mut impl Write,
) -> io::Result<(Digest, u64)> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; CHUNK];
    let mut size = 0u64;
    loop {
        let n = match reader.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        hasher.update(&buf[..n]);
        out.write_all(&buf[..n])?;
        size += n as u64;
    }
    out.flush()?;
    Ok((Digest::from_hasher(hasher), size))
}

/// A hash over a prefix already on disk (a partial fetch), to go on hashing what arrives.
pub fn hash_prefix(file: &Path) -> io::Result<(Sha256, u64)> {
    let mut hasher = Sha256::new();
    let mut reader = File::open(file)?;
    let mut buf = vec![0u8; CHUNK];
    let mut size = 0u64;
    loop {
        match reader.read(&mut buf) {
            Ok(0) => return Ok((hasher, size)),
            Ok(n) => {
                hasher.update(&buf[..n]);
                size += n as u64;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// How a stream of `want` bytes ended.
#[derive(Debug)]
pub enum Streamed {
    /// All `want` bytes arrived and were written.
    Done,
    /// The reader stopped after `got` of them.
    Cut { got: u64, cause: String },
    /// The writer failed (the disk) after `got` bytes.
    Write { got: u64, cause: io::Error },
}

/// Moves exactly `want` bytes from `from` to `to`, hashing each as it passes when given a
/// hasher.
pub async fn stream_exact<R, W>(
    from: &mut R,
    to: &mut W,
    want: u64,
    mut hasher: Option<&mut Sha256>,
) -> Streamed
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    // No bigger than what is sent: a wave of small programs' sends would each hold a whole chunk.
    let mut buf = vec![0u8; want.min(CHUNK as u64) as usize];
    let mut got = 0u64;
    while got < want {
        let room = (want - got).min(CHUNK as u64) as usize;
        let n = match from.read(&mut buf[..room]).await {
            Ok(0) => {
                return Streamed::Cut {
                    got,
                    cause: "the peer closed the connection".into(),
                };
            }
            Ok(n) => n,
            Err(e) => {
                return Streamed::Cut {
                    got,
                    cause: e.to_string(),
                };
            }
        };
        if let Some(hasher) = hasher.as_deref_mut() {
            hasher.update(&buf[..n]);
        }
        if let Err(cause) = to.write_all(&buf[..n]).await {
            return Streamed::Write { got, cause };
        }
        got += n as u64;
    }
    match to.flush().await {
        Ok(()) => Streamed::Done,
        Err(cause) => Streamed::Write { got, cause },
    }
}

/// Lands `digest` in `blobs` through a [`Landing`], from what an earlier try left. `open(offset)`
/// gives the stream, the content's whole size, and the offset the stream really starts at (0
/// from a source that cannot resume: the landing starts over).
pub async fn land<S, F, Fut>(
    blobs: &Blobs,
    digest: &Digest,
    open: F,
) -> Result<PathBuf, ContentError>
where
    S: AsyncRead + Unpin,
    F: FnOnce(u64) -> Fut,
    Fut: Future<Output = Result<(S, u64, u64), ContentError>>,
{
    let whole = blobs.path(digest);
    if whole.is_file() {
        return Ok(whole);
    }
    let stopped = |size, e| content_error(blobs, digest, size, e);
    let mut landing = Landing::blob(blobs, digest)
        .await
        .map_err(|e| stopped(0, e))?;
    let (mut stream, size, offset) = open(landing.held()).await?;
    (landing.receive(&mut stream, offset, size).await).map_err(|e| stopped(size, e))?;
    let path = landing.finish(digest).await.map_err(|e| stopped(size, e))?;
    tracing::info!(%digest, size, resumed_from = offset, "content fetched and checked");
    Ok(path)
}

/// Why a landing of `digest` (`size` bytes) stopped, as a content error.
fn content_error(blobs: &Blobs, digest: &Digest, size: u64, stopped: Stopped) -> ContentError {
    match stopped {
        Stopped::Disk(cause) if is_no_space(&cause) => ContentError::NoSpace {
            digest: *digest,
            dir: blobs.root().to_path_buf(),
            cause,
        },
        Stopped::Disk(cause) => ContentError::Failed {
            content: digest.to_string(),
            reason: format!("cannot write under {} ({cause})", blobs.root().display()),
        },
        Stopped::Cut { got, cause } => ContentError::Cut {
            content: digest.to_string(),
            got,
            size,
            cause,
        },
        Stopped::Mismatch { got } => ContentError::Mismatch {
            digest: *digest,
            got,
        },
    }
}

/// Whether an I/O error says the disk is full.
pub fn is_no_space(e: &io::Error) -> bool {
    e.raw_os_error() == Some(28) || e.kind() == io::ErrorKind::StorageFull
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn import_checks_the_digest_and_a_taken_upload_lands_whole_or_not_at_all() {
        let dir = std::env::temp_dir().join(format!("blobs-test-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let blobs = Blobs::new(dir.join("blobs"));
        let source = dir.join("source");
        fs::write(&source, b"hello").unwrap();
        let (digest, size) = blobs.import(&source).unwrap();
        assert_eq!(size, 5);
        assert_eq!(digest, Digest::of_reader(&b"hello"[..]).unwrap());
        assert!(blobs.has(&digest));

        // A checked upload is moved to --out, and is gone from the store.
        fs::create_dir_all(dir.join("blobs/collected")).unwrap();
        let u1 = UploadId::new("u1");
        fs::write(blobs.collected(&u1), b"hello").unwrap();
        let out = dir.join("out");
        blobs.take_collected(&u1, &digest, &out).unwrap();
        assert_eq!(fs::read(&out).unwrap(), b"hello");
        assert!(!blobs.collected(&u1).exists());
        // One taken already (or swept) is named, and nothing lands at --out.
        let out2 = dir.join("out2");
        let err = blobs.take_collected(&u1, &digest, &out2).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "content {digest}: the coordinator holds no upload of it any more; collect it again"
            )
        );
        assert!(!out2.exists());
        // Onto another filesystem (tmpfs, where there is one): copied whole, no temporary left.
        let shm = Path::new("/dev/shm");
        use std::os::unix::fs::MetadataExt;
        if shm.is_dir() && fs::metadata(shm).unwrap().dev() != fs::metadata(&dir).unwrap().dev() {
            fs::write(blobs.collected(&UploadId::new("u2")), b"hello").unwrap();
            let far = shm.join(format!("blobs-test-{}", std::process::id()));
            blobs
                .take_collected(&UploadId::new("u2"), &digest, &far)
                .unwrap();
            assert_eq!(fs::read(&far).unwrap(), b"hello");
            assert!(!blobs.collected(&UploadId::new("u2")).exists());
            fs::remove_file(&far).unwrap();
            let left = fs::read_dir(shm)
                .unwrap()
                .filter(|e| {
                    (e.as_ref().unwrap().file_name().to_string_lossy())
                        .contains(&format!("tmp-{}", std::process::id()))
                })
                .count();
            assert_eq!(left, 0, "no temporary file left");
        }
        let names: Vec<_> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 3, "no temporary file left: {names:?}");
        assert_eq!(fs::read_dir(dir.join("blobs/tmp")).unwrap().count(), 0);

        // What transfers left behind goes once untouched for the grace; whole blobs stay.
        fs::write(blobs.collected_partial(&UploadId::new("u3")), b"hel").unwrap();
        assert!(
            (blobs
                .remove_stale(std::time::Duration::from_secs(60))
                .unwrap())
            .is_empty(),
            "too young"
        );
        let removed = blobs.remove_stale(std::time::Duration::ZERO).unwrap();
        assert_eq!(removed, [blobs.collected_partial(&UploadId::new("u3"))]);
        assert!(blobs.has(&digest));
        fs::remove_dir_all(&dir).unwrap();
    }
}
