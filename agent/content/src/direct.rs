//! A file written past the page cache (`O_DIRECT`) where the filesystem allows it. A GiB
//! written through the cache on a machine whose memory is full of cache cost up to 3.4 s of the
//! kernel's time finding pages (0.4 s when memory was free), and two such writes at once (an
//! import and its copy on another coordinator) did not overlap; written direct, each goes at the
//! disk's speed, whatever the cache holds. Whole blocks go direct, each on a thread of its own
//! while the caller fills the next (a direct write waits for the disk: the caller's hashing goes
//! on meanwhile); the tail after the last block goes through the cache, and
//! [`DirectWriter::finish`] syncs it all.
use rustix::fs::OFlags;
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::Path;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;

/// What a direct write's buffer, offset and length must be a multiple of (the largest logical
/// block size in use).
const ALIGN: usize = 4096;
/// Bytes gathered before each direct write.
const BLOCK: usize = 1 << 20;
/// Blocks in all: one filling while the others are written or wait to be.
const BLOCKS: usize = 3;

/// BLOCK bytes at an ALIGN boundary, inside an allocation ALIGN larger.
struct Block {
    space: Vec<u8>,
    start: usize,
}

impl Block {
    fn new() -> Block {
        let space = vec![0u8; BLOCK + ALIGN];
        let start = space.as_ptr().align_offset(ALIGN);
        Block { space, start }
    }

    fn bytes(&self, len: usize) -> &[u8] {
        &self.space[self.start..self.start + len]
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.space[self.start..self.start + BLOCK]
    }
}

/// The file and how it is written: the writer's thread owns it once the first block is full.
struct Disk {
    file: File,
    direct: bool,
}

impl Disk {
    /// Writes `len` bytes of `block`: its whole ALIGN units direct, a tail through the cache.
    fn write(&mut self, block: &Block, len: usize) -> io::Result<()> {
        let whole = len / ALIGN * ALIGN;
        match self.file.write_all(block.bytes(whole)) {
            Ok(()) => {}
            // A device that wants another alignment: the rest goes through the cache.
            Err(e) if self.direct && e.raw_os_error() == Some(EINVAL) => {
                self.go_through_cache()?;
                self.file.write_all(block.bytes(whole))?;
            }
            Err(e) => return Err(e),
        }
        if len > whole {
            self.go_through_cache()?;
            self.file.write_all(&block.bytes(len)[whole..])?;
        }
        Ok(())
    }

    /// Writes past the cache from now on, where the filesystem allows it (tmpfs does not).
    fn go_direct(&mut self) {
        let Ok(flags) = rustix::fs::fcntl_getfl(&self.file) else {
            return;
        };
        self.direct = rustix::fs::fcntl_setfl(&self.file, flags | OFlags::DIRECT).is_ok();
    }

    fn go_through_cache(&mut self) -> io::Result<()> {
        if self.direct {
            let flags = rustix::fs::fcntl_getfl(&self.file)?;
            rustix::fs::fcntl_setfl(&self.file, flags - OFlags::DIRECT)?;
            self.direct = false;
        }
        Ok(())
    }
}

/// The thread that writes full blocks and hands them back empty.
struct Writer {
    full: SyncSender<Block>,
    empty: Receiver<Block>,
    thread: JoinHandle<io::Result<Disk>>,
}

impl Writer {
    fn start(mut disk: Disk) -> io::Result<Writer> {
        let (full, blocks) = sync_channel::<Block>(BLOCKS);
        let (emptied, empty) = sync_channel::<Block>(BLOCKS);
        let thread = std::thread::Builder::new()
            .name("direct-write".into())
            .spawn(move || {
                for block in blocks {
                    disk.write(&block, BLOCK)?;
                    // The caller may have stopped taking them: it is dropping the writer.
                    let _ = emptied.send(block);
                }
                Ok(disk)
            })?;
        Ok(Writer {
            full,
            empty,
            thread,
        })
    }

    /// Waits for every block sent to be written; returns the file, or why a write failed.
    fn stop(self) -> io::Result<Disk> {
        drop(self.full);
        self.thread
            .join()
            .unwrap_or_else(|_| Err(io::Error::other("the direct writer's thread panicked")))
    }
}

/// Writes a new file or appends to one, direct where it can (see the module's doc).
pub struct DirectWriter {
    state: State,
    filling: Block,
    len: usize,
    /// Blocks made so far (at most [`BLOCKS`]).
    made: usize,
    /// Bytes still to write through the cache before the writes go direct (an append to a file
    /// whose length is not a multiple of [`ALIGN`]).
    head: usize,
}

/// Where the file is: here until the first block is full (a small file needs no thread), then
/// with its writer's thread.
enum State {
    Here(Disk),
    Threaded(Writer),
    Failed,
}

impl DirectWriter {
    /// Creates `path` (which must not exist).
    pub fn create(path: &Path) -> io::Result<DirectWriter> {
        let file = OpenOptions::new().write(true).create_new(true).open(path)?;
        Ok(DirectWriter::over(file, 0))
    }

    /// Appends to `path` (made when absent), after what it holds: a head up to the next
    /// [`ALIGN`] boundary goes through the cache, so the direct writes start aligned.
    pub fn append(path: &Path) -> io::Result<DirectWriter> {
        let file = OpenOptions::new().append(true).create(true).open(path)?;
        let held = file.metadata()?.len();
        let head = (ALIGN - (held % ALIGN as u64) as usize) % ALIGN;
        Ok(DirectWriter::over(file, head))
    }

    fn over(file: File, head: usize) -> DirectWriter {
        let mut disk = Disk {
            file,
            direct: false,
        };
        if head == 0 {
            disk.go_direct();
        }
        DirectWriter {
            state: State::Here(disk),
            filling: Block::new(),
            len: 0,
            made: 1,
            head,
        }
    }

    /// Writes the head through the cache; at its end the writes go direct.
    fn write_head(&mut self, data: &[u8]) -> io::Result<usize> {
        let State::Here(disk) = &mut self.state else {
            return Err(failed_before());
        };
        let n = data.len().min(self.head);
        disk.file.write_all(&data[..n])?;
        self.head -= n;
        if self.head == 0 {
            disk.go_direct();
        }
        Ok(n)
    }

    /// Writes what is gathered, syncs the file and closes it.
    pub fn finish(mut self) -> io::Result<()> {
        let mut disk = match std::mem::replace(&mut self.state, State::Failed) {
            State::Here(disk) => disk,
            State::Threaded(writer) => writer.stop()?,
            State::Failed => return Err(failed_before()),
        };
        disk.write(&self.filling, self.len)?;
        disk.file.sync_all()
    }

    /// Hands the full block to the writer's thread and takes an empty one to fill.
    fn send_full(&mut self) -> io::Result<()> {
        let writer = match std::mem::replace(&mut self.state, State::Failed) {
            State::Here(disk) => Writer::start(disk)?,
            State::Threaded(writer) => writer,
            State::Failed => return Err(failed_before()),
        };
        let next = match writer.empty.try_recv() {
            Ok(block) => Some(block),
            Err(_) if self.made < BLOCKS => {
                self.made += 1;
                Some(Block::new())
            }
            Err(_) => writer.empty.recv().ok(),
        };
        let full = next.map(|next| std::mem::replace(&mut self.filling, next));
        match full.map(|full| writer.full.send(full)) {
            Some(Ok(())) => {
                self.state = State::Threaded(writer);
                self.len = 0;
                Ok(())
            }
            // The thread stopped: its answer says why.
            _ => Err(writer
                .stop()
                .err()
                .unwrap_or_else(|| io::Error::other("the direct writer stopped early"))),
        }
    }
}

fn failed_before() -> io::Error {
    io::Error::other("an earlier write to this file failed")
}

impl Write for DirectWriter {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        if self.head > 0 {
            return self.write_head(data);
        }
        let n = data.len().min(BLOCK - self.len);
        self.filling.bytes_mut()[self.len..self.len + n].copy_from_slice(&data[..n]);
        self.len += n;
        if self.len == BLOCK {
            self.send_full()?;
        }
        Ok(n)
    }

    /// Whole blocks are written as they fill; the tail waits for [`DirectWriter::finish`].
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// `open(2)`'s answer to a flag the filesystem does not take.
const EINVAL: i32 = 22;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_written_direct_reads_back_whole_at_every_size() {
        let dir = tempfile::tempdir().unwrap();
        for size in [
            0,
            1,
            ALIGN - 1,
            ALIGN,
            BLOCK - 1,
            BLOCK,
            BLOCK + ALIGN + 7,
            3 * BLOCK,
            // More blocks than the writer keeps: the full ones wait for the disk.
            7 * BLOCK + 5,
        ] {
            let bytes: Vec<u8> = (0..size).map(|i| (i * 31 % 251) as u8).collect();
            let path = dir.path().join(format!("f-{size}"));
            let mut writer = DirectWriter::create(&path).unwrap();
            // In uneven pieces, as reads return them.
            for piece in bytes.chunks(100_003) {
                writer.write_all(piece).unwrap();
            }
            writer.finish().unwrap();
            assert_eq!(std::fs::read(&path).unwrap(), bytes, "size {size}");
        }
    }

    #[test]
    fn an_append_after_any_length_reads_back_whole() {
        let dir = tempfile::tempdir().unwrap();
        for (held, more) in [
            (0, BLOCK + 3),
            (1, ALIGN),
            (ALIGN - 1, 2),
            (ALIGN, 3 * BLOCK),
            (ALIGN + 5, 5 * BLOCK + ALIGN - 1),
        ] {
            let bytes: Vec<u8> = (0..held + more).map(|i| (i * 17 % 253) as u8).collect();
            let path = dir.path().join(format!("f-{held}-{more}"));
            if held > 0 {
                std::fs::write(&path, &bytes[..held]).unwrap();
            }
            let mut writer = DirectWriter::append(&path).unwrap();
            for piece in bytes[held..].chunks(77_777) {
                writer.write_all(piece).unwrap();
            }
            writer.finish().unwrap();
            assert_eq!(std::fs::read(&path).unwrap(), bytes, "{held} then {more}");
        }
    }

    #[test]
    fn an_existing_file_is_not_written_over() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, b"kept").unwrap();
        assert!(DirectWriter::create(&path).is_err());
        assert_eq!(std::fs::read(&path).unwrap(), b"kept");
    }
}
