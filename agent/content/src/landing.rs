//! The one landing every transfer into a blob store goes through: a node's fetch, an artifact's
//! copy, a copy between coordinators, a collect's upload and a pushed copy. What an earlier try
//! left is taken up (hashed again, so the next bytes go on from it), what arrives is hashed and
//! written past the page cache on a thread of its own while the next bytes are read, and only a
//! whole that hashes to the expected or the sent digest is put in place, as a blob or as a
//! collected file.
use crate::direct::DirectWriter;
use crate::{Blobs, CHUNK, hash_prefix};
use fleet_cli::blocking::off_thread;
use fleet_vocab::{Digest, UploadId};
use sha2::{Digest as _, Sha256};
use std::fs::OpenOptions;
use std::io::{self, Write};
use std::path::PathBuf;
use tokio::io::{AsyncRead, AsyncReadExt};

/// Pieces read ahead of a landing's disk write.
const PIECES_AHEAD: usize = 4;

/// Where a landing puts its content once whole and checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Place {
    /// A blob, under its digest.
    Blob,
    /// The upload of the collect so named, for the CLI to take ([`Blobs::take_collected`]).
    Collected(UploadId),
}

/// Why a landing stopped; the caller words it for whoever waits.
#[derive(Debug)]
pub enum Stopped {
    /// The disk failed (see [`crate::is_no_space`]); what arrived is removed.
    Disk(io::Error),
    /// The source stopped after `got` bytes of the content in all; a resumable landing keeps
    /// them, and its next try starts there.
    Cut { got: u64, cause: String },
    /// The whole hashes to `got`, not to the digest it was checked against; removed.
    Mismatch { got: Digest },
}

/// Content on its way into a [`Blobs`]: its file so far, and the hash of what the file holds.
pub struct Landing {
    blobs: Blobs,
    file: PathBuf,
    place: Place,
    /// Kept across tries (a fetch's or an upload's partial file), else removed when dropped
    /// unfinished (a pushed copy's temporary file).
    resumable: bool,
    hasher: Sha256,
    held: u64,
    placed: bool,
}

impl Landing {
    /// The blob `digest`, from what an earlier try left of it.
    pub async fn blob(blobs: &Blobs, digest: &Digest) -> Result<Landing, Stopped> {
        Landing::take_up(blobs, blobs.partial(digest), Place::Blob, u64::MAX).await
    }

    /// The `size` bytes of the collect's upload `upload`, from what an earlier try left (a
    /// leftover longer than that starts over), put in place as `place`.
    pub async fn upload(
        blobs: &Blobs,
        upload: &UploadId,
        size: u64,
        place: Place,
    ) -> Result<Landing, Stopped> {
        Landing::take_up(blobs, blobs.collected_partial(upload), place, size).await
    }

    /// A pushed copy, into a fresh temporary file (a cut push leaves nothing), kept as a blob.
    pub async fn push(blobs: &Blobs) -> Result<Landing, Stopped> {
        let file = off_thread({
            let blobs = blobs.clone();
            move || blobs.temp()
        })
        .await
        .map_err(Stopped::Disk)?;
        Ok(Landing {
            blobs: blobs.clone(),
            file,
            place: Place::Blob,
            resumable: false,
            hasher: Sha256::default(),
            held: 0,
            placed: false,
        })
    }

    async fn take_up(
        blobs: &Blobs,
        file: PathBuf,
        place: Place,
        most: u64,
    ) -> Result<Landing, Stopped> {
        // Hashing what an earlier try left reads a whole file: on the blocking pool, as every
        // other file step here, so a caller's async thread never waits for a disk.
        let (hasher, held) = off_thread({
            let file = file.clone();
            move || {
                // Cannot fail: the partial path is built as a file inside the blob store's folder.
                std::fs::create_dir_all(file.parent().expect("a folder"))?;
                match hash_prefix(&file) {
                    Ok((_, held)) if held > most => {
                        std::fs::remove_file(&file)?;
                        Ok((Sha256::default(), 0))
                    }
                    Ok(prefix) => Ok(prefix),
                    Err(e) if e.kind() == io::ErrorKind::NotFound => Ok((Sha256::default(), 0)),
                    Err(e) => Err(e),
                }
            }
        })
        .await
        .map_err(Stopped::Disk)?;
        Ok(Landing {
            blobs: blobs.clone(),
            file,
            place,
            resumable: true,
            hasher,
            held,
            placed: false,
        })
    }

    /// The bytes held already: where the source is asked to start.
    pub fn held(&self) -> u64 {
        self.held
    }

    /// Receives the rest of a `size`-byte content from `from`, which starts at byte `offset`:
    /// what is held, or 0 from a source that cannot resume (the landing then starts over).
    /// Returns the bytes this try received.
    pub async fn receive<R: AsyncRead + Unpin>(
        &mut self,
        from: &mut R,
        offset: u64,
        size: u64,
    ) -> Result<u64, Stopped> {
        if offset != self.held {
            self.start_over().await?;
        }
        if offset != self.held {
            return Err(Stopped::Cut {
                got: self.held,
                cause: format!("the source sent from byte {offset}, not from 0"),
            });
        }
        if self.held > size {
            self.start_over().await?;
            return Err(Stopped::Cut {
                got: 0,
                cause: format!(
                    "the partial copy was longer ({offset} bytes) than the content; removed it"
                ),
            });
        }
        let rest = size - offset;
        let (got, cut, written) = match rest <= CHUNK as u64 {
            true => self.receive_piece(from, rest).await,
            false => self.receive_streamed(from, rest).await,
        };
        match written {
            Ok(hasher) => {
                self.hasher = hasher;
                self.held += got;
            }
            Err(e) => {
                self.start_over().await?;
                return Err(Stopped::Disk(e));
            }
        }
        match cut {
            None => Ok(got),
            Some(cause) if !self.resumable => {
                self.start_over().await?;
                Err(Stopped::Cut { got, cause })
            }
            Some(cause) => Err(Stopped::Cut {
                got: self.held,
                cause,
            }),
        }
    }

    /// Content of one piece: read here, then hashed, appended and synced in one step on the
    /// blocking pool. Thousands of small landings at once then hold no writer thread through
    /// their transfer and map no block each (which stalled every thread of `fleet-loadgen` on
    /// the process's memory map in `bench fleet`).
    async fn receive_piece<R: AsyncRead + Unpin>(
        &mut self,
        from: &mut R,
        rest: u64,
    ) -> (u64, Option<String>, io::Result<Sha256>) {
        let mut piece = vec![0u8; rest as usize];
        let (filled, cut) = fill(from, &mut piece).await;
        piece.truncate(filled);
        let (file, mut hasher) = (self.file.clone(), std::mem::take(&mut self.hasher));
        let written = off_thread(move || {
            hasher.update(&piece);
            let mut out = (OpenOptions::new().append(true).create(true)).open(&file)?;
            out.write_all(&piece)?;
            out.sync_all()?;
            Ok(hasher)
        })
        .await;
        (filled as u64, cut, written)
    }

    /// Larger content: pieces read here while a thread of its own hashes them and appends them
    /// past the page cache.
    async fn receive_streamed<R: AsyncRead + Unpin>(
        &mut self,
        from: &mut R,
        rest: u64,
    ) -> (u64, Option<String>, io::Result<Sha256>) {
        let (pieces, mut inbox) = tokio::sync::mpsc::channel::<Vec<u8>>(PIECES_AHEAD);
        // Pieces come back to be filled again: a fresh CHUNK each time cost a map, its pages'
        // faults and an unmap per piece.
        let (spent, mut spare) = tokio::sync::mpsc::channel::<Vec<u8>>(PIECES_AHEAD + 1);
        let (file, mut hasher) = (self.file.clone(), std::mem::take(&mut self.hasher));
        let writing = tokio::task::spawn_blocking(move || {
            let mut out = DirectWriter::append(&file)?;
            while let Some(piece) = inbox.blocking_recv() {
                hasher.update(&piece);
                out.write_all(&piece)?;
                let _ = spent.try_send(piece);
            }
            out.finish()?;
            Ok::<_, io::Error>(hasher)
        });
        let (mut got, mut cut) = (0u64, None);
        while got < rest && cut.is_none() {
            let mut piece = spare.try_recv().unwrap_or_default();
            piece.resize(CHUNK.min((rest - got) as usize), 0);
            let filled;
            (filled, cut) = fill(from, &mut piece).await;
            piece.truncate(filled);
            got += filled as u64;
            if filled > 0 && pieces.send(piece).await.is_err() {
                break;
            }
        }
        drop(pieces);
        let written = (writing.await)
            .unwrap_or_else(|e| Err(io::Error::other(format!("the write did not complete: {e}"))));
        (got, cut, written)
    }

    /// Checks what landed against `digest` (the expected one, or the one the sender sent) and
    /// puts it in place for good; returns where it is.
    pub async fn finish(mut self, digest: &Digest) -> Result<PathBuf, Stopped> {
        let got = Digest::from_hasher(std::mem::take(&mut self.hasher));
        if got != *digest {
            self.start_over().await?;
            return Err(Stopped::Mismatch { got });
        }
        let placed = off_thread({
            let (blobs, file, place, digest) = (
                self.blobs.clone(),
                self.file.clone(),
                self.place.clone(),
                *digest,
            );
            move || blobs.place(&file, &digest, &place)
        })
        .await;
        match placed {
            Ok(path) => {
                self.placed = true;
                Ok(path)
            }
            Err(e) => {
                self.start_over().await?;
                Err(Stopped::Disk(e))
            }
        }
    }

    /// Removes what is held: the next bytes start from 0.
    async fn start_over(&mut self) -> Result<(), Stopped> {
        match tokio::fs::remove_file(&self.file).await {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(Stopped::Disk(e)),
        }
        (self.hasher, self.held) = (Sha256::default(), 0);
        Ok(())
    }
}

/// Reads into the whole of `piece` unless the source stops first: the bytes read, and why it
/// stopped.
async fn fill<R: AsyncRead + Unpin>(from: &mut R, piece: &mut [u8]) -> (usize, Option<String>) {
    let mut filled = 0;
    while filled < piece.len() {
        match from.read(&mut piece[filled..]).await {
            Ok(0) => return (filled, Some("the peer closed the connection".to_string())),
            Ok(n) => filled += n,
            Err(e) => return (filled, Some(e.to_string())),
        }
    }
    (filled, None)
}

impl Drop for Landing {
    fn drop(&mut self) {
        if !self.resumable && !self.placed {
            let _ = std::fs::remove_file(&self.file);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 13 % 241) as u8).collect()
    }

    #[tokio::test]
    async fn a_cut_fetch_resumes_and_lands_only_when_whole_and_matching() {
        let dir = tempfile::tempdir().unwrap();
        let blobs = Blobs::new(dir.path());
        let content = bytes(3 * CHUNK + 5);
        let digest = Digest::of_reader(&content[..]).unwrap();
        // A source that stops at an unaligned byte: what arrived is kept.
        let mut landing = Landing::blob(&blobs, &digest).await.unwrap();
        let half = CHUNK + 1001;
        let size = content.len() as u64;
        match landing.receive(&mut &content[..half], 0, size).await {
            Err(Stopped::Cut { got, .. }) => assert_eq!(got, half as u64),
            other => panic!("{other:?}"),
        }
        drop(landing);
        let mut landing = Landing::blob(&blobs, &digest).await.unwrap();
        assert_eq!(landing.held(), half as u64);
        let got = landing
            .receive(&mut &content[half..], half as u64, size)
            .await;
        assert_eq!(got.unwrap(), (content.len() - half) as u64);
        let path = landing.finish(&digest).await.unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), content);
        assert!(!blobs.partial(&digest).exists());

        // Another digest's bytes: removed, nothing in place.
        let other = Digest::of_reader(&b"other"[..]).unwrap();
        let mut landing = Landing::blob(&blobs, &other).await.unwrap();
        landing.receive(&mut &content[..], 0, size).await.unwrap();
        match landing.finish(&other).await {
            Err(Stopped::Mismatch { got }) => assert_eq!(got, digest),
            other => panic!("{other:?}"),
        }
        assert!(!blobs.has(&other) && !blobs.partial(&other).exists());
    }

    #[tokio::test]
    async fn a_source_that_cannot_resume_starts_the_landing_over() {
        let dir = tempfile::tempdir().unwrap();
        let blobs = Blobs::new(dir.path());
        let content = bytes(10_000);
        let digest = Digest::of_reader(&content[..]).unwrap();
        std::fs::create_dir_all(blobs.partial(&digest).parent().unwrap()).unwrap();
        std::fs::write(blobs.partial(&digest), b"stale bytes").unwrap();
        let mut landing = Landing::blob(&blobs, &digest).await.unwrap();
        assert_eq!(landing.held(), 11);
        (landing.receive(&mut &content[..], 0, 10_000).await).unwrap();
        assert_eq!(
            std::fs::read(landing.finish(&digest).await.unwrap()).unwrap(),
            content
        );
    }

    #[tokio::test]
    async fn an_upload_lands_as_its_collect_or_as_a_blob_and_a_cut_push_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let blobs = Blobs::new(dir.path());
        let content = bytes(5000);
        let digest = Digest::of_reader(&content[..]).unwrap();
        let upload = UploadId::new("u1");
        // A leftover longer than the upload starts over.
        std::fs::create_dir_all(blobs.collected_partial(&upload).parent().unwrap()).unwrap();
        std::fs::write(blobs.collected_partial(&upload), bytes(6000)).unwrap();
        let place = Place::Collected(upload.clone());
        let mut landing = Landing::upload(&blobs, &upload, 5000, place).await.unwrap();
        assert_eq!(landing.held(), 0);
        landing.receive(&mut &content[..], 0, 5000).await.unwrap();
        assert_eq!(
            landing.finish(&digest).await.unwrap(),
            blobs.collected(&upload)
        );
        assert_eq!(std::fs::read(blobs.collected(&upload)).unwrap(), content);

        let relayed = UploadId::new("u2");
        let mut landing = (Landing::upload(&blobs, &relayed, 5000, Place::Blob).await).unwrap();
        landing.receive(&mut &content[..], 0, 5000).await.unwrap();
        assert_eq!(landing.finish(&digest).await.unwrap(), blobs.path(&digest));

        let mut landing = Landing::push(&blobs).await.unwrap();
        let cut = landing.receive(&mut &content[..100], 0, 5000).await;
        assert!(matches!(cut, Err(Stopped::Cut { got: 100, .. })), "{cut:?}");
        drop(landing);
        assert_eq!(
            std::fs::read_dir(dir.path().join("tmp")).unwrap().count(),
            0
        );
    }
}
