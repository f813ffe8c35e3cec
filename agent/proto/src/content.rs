//! Content by digest: the folder of content-addressed blobs both sides keep, and the streaming,
//! hashing copy every transfer goes through. Memory stays flat with the content's size: one
//! buffer of [`CHUNK`] bytes per transfer.
use run_store::Digest;
use sha2::{Digest as _, Sha256};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The buffer each transfer moves bytes through.
pub const CHUNK: usize = 256 << 10;

static TEMPS: AtomicU64 = AtomicU64::new(0);

/// Why content could not be moved or used; every message names the digest and what to do.
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
        "content {digest}: the transfer stopped after {got} of {size} bytes ({cause}); the next try resumes from there"
    )]
    Cut {
        digest: Digest,
        got: u64,
        size: u64,
        cause: String,
    },
    #[error("content {digest}: {reason}")]
    Failed { digest: Digest, reason: String },
}

impl ContentError {
    /// Whether trying again may help (a cut connection), rather than repeat the same failure.
    pub fn is_retryable(&self) -> bool {
        matches!(self, ContentError::Cut { .. })
    }
}

/// Content-addressed files under one folder: `sha256/HEX` when whole and checked, `partial/HEX`
/// while a fetch is under way (kept across cuts, so a fetch resumes), `tmp/` for uploads.
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

    /// Moves a checked file into place under its digest: fsync, rename, fsync of the folder.
    pub fn commit(&self, file: &Path, digest: &Digest) -> io::Result<PathBuf> {
        File::open(file)?.sync_all()?;
        let dest = self.path(digest);
        let dir = dest.parent().expect("blob paths have a folder");
        fs::create_dir_all(dir)?;
        fs::rename(file, &dest)?;
        File::open(dir)?.sync_all()?;
        Ok(dest)
    }

    /// Streams a file into the store (hashing as it reads) and returns its digest and size.
    pub fn import(&self, source: &Path) -> io::Result<(Digest, u64)> {
        let temp = self.temp()?;
        let result = (|| {
            let mut reader = File::open(source)?;
            let mut out = OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&temp)?;
            let (digest, size) = copy_hashing(&mut reader, &mut out)?;
            drop(out);
            self.commit(&temp, &digest)?;
            Ok((digest, size))
        })();
        if result.is_err() {
            let _ = fs::remove_file(&temp);
        }
        result
    }

    /// Copies the blob of `digest` to `out` atomically, checking its bytes as they are copied;
    /// on any failure nothing is left at `out`.
    pub fn export(&self, digest: &Digest, out: &Path) -> Result<u64, ContentError> {
        let failed = |reason: String| ContentError::Failed {
            digest: digest.clone(),
            reason,
        };
        let dir = match out.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let name = out.file_name().and_then(|n| n.to_str()).unwrap_or("out");
        let temp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
        let result = (|| {
            let mut reader = File::open(self.path(digest)).map_err(|e| {
                failed(format!(
                    "the coordinator holds no copy ({e}); collect it again"
                ))
            })?;
            let mut file = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .open(&temp)
                .map_err(|e| failed(format!("cannot write {} ({e})", temp.display())))?;
            let (got, size) = copy_hashing(&mut reader, &mut file)
                .map_err(|e| failed(format!("cannot copy it to {} ({e})", out.display())))?;
            if got != *digest {
                return Err(ContentError::Mismatch {
                    digest: digest.clone(),
                    got,
                });
            }
            file.sync_all()
                .and_then(|()| fs::rename(&temp, out))
                .map_err(|e| failed(format!("cannot write {} ({e})", out.display())))?;
            Ok(size)
        })();
        if result.is_err() {
            let _ = fs::remove_file(&temp);
        }
        result
    }
}

/// Copies everything, hashing it, through one buffer.
pub fn copy_hashing(reader: &mut impl Read, out: &mut impl Write) -> io::Result<(Digest, u64)> {
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
    let mut buf = vec![0u8; CHUNK];
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

/// Whether an I/O error says the disk is full.
pub fn is_no_space(e: &io::Error) -> bool {
    e.raw_os_error() == Some(28) || e.kind() == io::ErrorKind::StorageFull
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn import_and_export_check_the_digest() {
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
        let out = dir.join("out");
        assert_eq!(blobs.export(&digest, &out).unwrap(), 5);
        assert_eq!(fs::read(&out).unwrap(), b"hello");
        // A blob changed on disk is refused, and nothing lands at --out.
        fs::write(blobs.path(&digest), b"hellO").unwrap();
        let out2 = dir.join("out2");
        let err = blobs.export(&digest, &out2).unwrap_err();
        assert!(
            err.to_string()
                .starts_with(&format!("content {digest}: the bytes received hash to")),
            "{err}"
        );
        assert!(!out2.exists());
        let names: Vec<_> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 3, "no temporary file left: {names:?}");
        assert_eq!(fs::read_dir(dir.join("blobs/tmp")).unwrap().count(), 0);
        fs::remove_dir_all(&dir).unwrap();
    }
}
