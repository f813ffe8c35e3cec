//! Layer compression whose bytes never depend on the core or thread count: block-parallel gzip and fixed-parameter zstd.
//!
//! gzip works like pigz without dictionaries: the stream is cut into fixed 1 MiB blocks, each
//! deflated on its own by a worker and ended with a sync flush, so the blocks join into one
//! deflate stream; the CRC is computed in order on the writer's side. The cut points depend only
//! on the byte offsets, so any number of workers gives the same bytes. zstd's multithreaded mode
//! cuts jobs by its parameters alone (level and window), never by the worker count.
use flate2::{Compress, FlushCompress};
use std::collections::BTreeMap;
use std::io::{self, Write};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// The deflate level, pinned: changing it changes every gzip layer digest.
pub const GZIP_LEVEL: u32 = 4;
/// The gzip block size, pinned for the same reason.
pub const GZIP_BLOCK: usize = 1 << 20;
/// The zstd level, pinned.
pub const ZSTD_LEVEL: i32 = 3;
/// zstd's job size, pinned: jobs are cut by it (never by the worker count), and it bounds memory.
pub const ZSTD_JOB_SIZE: u32 = 2 << 20;

/// How a layer is compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// A plain tar.
    None,
    /// gzip (deflate by zlib-rs at [`GZIP_LEVEL`], blocks of [`GZIP_BLOCK`]).
    Gzip,
    /// zstd at [`ZSTD_LEVEL`].
    Zstd,
}

/// Why a compression name was refused.
#[derive(Debug, thiserror::Error)]
#[error("bad compression {0:?}: use gzip, zstd or none")]
pub struct CompressionError(pub String);

impl Compression {
    /// Parses `gzip`, `zstd` or `none`.
    pub fn parse(s: &str) -> Result<Compression, CompressionError> {
        match s {
            "none" => Ok(Compression::None),
            "gzip" => Ok(Compression::Gzip),
            "zstd" => Ok(Compression::Zstd),
            _ => Err(CompressionError(s.to_string())),
        }
    }

    /// The layer media type for this compression.
    pub fn media_type(self) -> &'static str {
        match self {
            Compression::None => crate::types::spec::MEDIA_TYPE_LAYER_TAR,
            Compression::Gzip => crate::types::spec::MEDIA_TYPE_LAYER_GZIP,
            Compression::Zstd => crate::types::spec::MEDIA_TYPE_LAYER_ZSTD,
        }
    }
}

/// The default worker count: the cores this process may use. It changes speed, never bytes.
pub fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, 16)
}

/// A writer that compresses what it is given into an inner writer.
pub struct Encoder<W: Write> {
    inner: Inner<W>,
}

enum Inner<W: Write> {
    None(W),
    Gzip(ParallelGzip<W>),
    Zstd(zstd::stream::write::Encoder<'static, W>),
}

impl<W: Write> Encoder<W> {
    /// Starts compressing into `out` with `threads` workers (at least one).
    pub fn new(compression: Compression, out: W, threads: usize) -> io::Result<Encoder<W>> {
        let threads = threads.max(1);
        let inner = match compression {
            Compression::None => Inner::None(out),
            Compression::Gzip => Inner::Gzip(ParallelGzip::new(out, threads)?),
            Compression::Zstd => {
                let mut z = zstd::stream::write::Encoder::new(out, ZSTD_LEVEL)?;
                // Multithreaded mode even with one worker: its output differs from single-threaded
                // mode, and must not change with the machine.
                z.multithread(threads as u32)?;
                z.set_parameter(zstd::zstd_safe::CParameter::JobSize(ZSTD_JOB_SIZE))?;
                z.include_checksum(false)?;
                Inner::Zstd(z)
            }
        };
        Ok(Encoder { inner })
    }

    /// Ends the stream and returns the inner writer.
    pub fn finish(self) -> io::Result<W> {
        match self.inner {
            Inner::None(w) => Ok(w),
            Inner::Gzip(g) => g.finish(),
            Inner::Zstd(z) => z.finish(),
        }
    }
}

impl<W: Write> Write for Encoder<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match &mut self.inner {
            Inner::None(w) => w.write(buf),
            Inner::Gzip(g) => g.write(buf),
            Inner::Zstd(z) => z.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        match &mut self.inner {
            Inner::None(w) => w.flush(),
            // Blocks are cut by offset only; flushing early would move a cut.
            Inner::Gzip(_) => Ok(()),
            Inner::Zstd(z) => z.flush(),
        }
    }
}

/// A fixed gzip header: no name, mtime 0, OS "unknown", so no host state leaks in.
const GZIP_HEADER: [u8; 10] = [0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0xff];

type Job = (u64, Vec<u8>, bool);
type Done = (u64, io::Result<Vec<u8>>);

struct ParallelGzip<W: Write> {
    out: W,
    crc: crc32fast::Hasher,
    total: u64,
    block: Vec<u8>,
    submitted: u64,
    written: u64,
    max_in_flight: u64,
    jobs: Option<SyncSender<Job>>,
    done: Receiver<Done>,
    ready: BTreeMap<u64, Vec<u8>>,
    workers: Vec<JoinHandle<()>>,
}

impl<W: Write> ParallelGzip<W> {
    fn new(mut out: W, threads: usize) -> io::Result<ParallelGzip<W>> {
        out.write_all(&GZIP_HEADER)?;
        let (jobs, job_rx) = sync_channel::<Job>(threads);
        let (done_tx, done) = sync_channel::<Done>(threads * 2 + 2);
        let job_rx = Arc::new(Mutex::new(job_rx));
        let workers = (0..threads)
            .map(|_| {
                let job_rx = Arc::clone(&job_rx);
                let done_tx = done_tx.clone();
                std::thread::spawn(move || deflate_worker(&job_rx, &done_tx))
            })
            .collect();
        Ok(ParallelGzip {
            out,
            crc: crc32fast::Hasher::new(),
            total: 0,
            block: Vec::with_capacity(GZIP_BLOCK),
            submitted: 0,
            written: 0,
            max_in_flight: threads as u64 + 2,
            jobs: Some(jobs),
            done,
            ready: BTreeMap::new(),
            workers,
        })
    }

    fn submit(&mut self, last: bool) -> io::Result<()> {
        let block = std::mem::replace(
            &mut self.block,
            Vec::with_capacity(if last { 0 } else { GZIP_BLOCK }),
        );
        self.crc.update(&block);
        self.total += block.len() as u64;
        let jobs = self
            .jobs
            .as_ref()
            // Cannot fail: the writer submits its last block only once, after every other.
            .expect("no block is submitted after the last");
        jobs.send((self.submitted, block, last))
            .map_err(|_| worker_gone())?;
        self.submitted += 1;
        // Bound the memory in flight: wait for the oldest block before getting further ahead.
        while self.submitted - self.written > self.max_in_flight {
            self.write_next(true)?;
        }
        while self.write_next(false)? {}
        Ok(())
    }

    /// Writes the next block in order if it is done (waiting for it when `wait`); says whether it did.
    fn write_next(&mut self, wait: bool) -> io::Result<bool> {
        loop {
            if let Some(bytes) = self.ready.remove(&self.written) {
                self.out.write_all(&bytes)?;
                self.written += 1;
                return Ok(true);
            }
            let (seq, result) = if wait {
                self.done.recv().map_err(|_| worker_gone())?
            } else {
                match self.done.try_recv() {
                    Ok(d) => d,
                    Err(_) => return Ok(false),
                }
            };
            self.ready.insert(seq, result?);
        }
    }

    fn finish(mut self) -> io::Result<W> {
        self.submit(true)?;
        self.jobs = None;
        while self.written < self.submitted {
            self.write_next(true)?;
        }
        for w in self.workers.drain(..) {
            w.join().map_err(|_| worker_gone())?;
        }
        let crc = self.crc.clone().finalize();
        self.out.write_all(&crc.to_le_bytes())?;
        // ISIZE is the length modulo 2^32, as RFC 1952 says.
        self.out.write_all(&(self.total as u32).to_le_bytes())?;
        Ok(self.out)
    }
}

impl<W: Write> Write for ParallelGzip<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = buf.len().min(GZIP_BLOCK - self.block.len());
        self.block.extend_from_slice(&buf[..n]);
        if self.block.len() == GZIP_BLOCK {
            self.submit(false)?;
        }
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn worker_gone() -> io::Error {
    io::Error::other("a gzip worker thread stopped")
}

fn deflate_worker(jobs: &Mutex<Receiver<Job>>, done: &SyncSender<Done>) {
    let mut z = Compress::new(flate2::Compression::new(GZIP_LEVEL), false);
    loop {
        let job = jobs.lock().map(|rx| rx.recv());
        let Ok(Ok((seq, block, last))) = job else {
            return;
        };
        z.reset();
        let result = deflate_block(&mut z, &block, last);
        if done.send((seq, result)).is_err() {
            return;
        }
    }
}

/// The unit of the stored-or-deflated choice within a block.
const CHUNK: usize = 32 << 10;

/// Whether a chunk looks like noise (already compressed or encrypted data), which deflate would
/// spend time on for nothing: every byte value occurs, none more than 1.5 times as often as
/// uniform. Integers only, so the choice, and the bytes, are the same on every machine.
fn looks_incompressible(chunk: &[u8]) -> bool {
    let mut counts = [0u32; 256];
    for &b in chunk {
        counts[b as usize] += 1;
    }
    let limit = (chunk.len() as u32 / 256) * 3 / 2;
    chunk.len() >= 4096 && counts.iter().all(|&c| c > 0 && c <= limit)
}

/// Deflates one block on its own: runs of compressible chunks are deflated and sync-flushed, noisy
/// chunks are stored as they are, and only the last block ends with a final (empty stored) block,
/// so the blocks concatenate into one valid deflate stream.
fn deflate_block(z: &mut Compress, input: &[u8], last: bool) -> io::Result<Vec<u8>> {
    let mut out = Vec::with_capacity(input.len() + input.len() / 16 + 64);
    let chunks: Vec<&[u8]> = input.chunks(CHUNK).collect();
    let mut i = 0;
    let mut fresh = true;
    while i < chunks.len() {
        if looks_incompressible(chunks[i]) {
            // After a sync flush the stream is byte-aligned: a stored block is a header byte
            // (BFINAL=0, BTYPE=00), LEN and its complement, then the bytes.
            let len = chunks[i].len() as u16;
            out.push(0);
            out.extend_from_slice(&len.to_le_bytes());
            out.extend_from_slice(&(!len).to_le_bytes());
            out.extend_from_slice(chunks[i]);
            i += 1;
            continue;
        }
        let start = i;
        while i < chunks.len() && !looks_incompressible(chunks[i]) {
            i += 1;
        }
        let run = &input[start * CHUNK..(i * CHUNK).min(input.len())];
        // Back-references must not reach over bytes the compressor did not see.
        if !fresh {
            z.reset();
        }
        fresh = false;
        deflate_run(z, run, &mut out)?;
    }
    if last {
        // The final block: stored, empty.
        out.extend_from_slice(&[1, 0, 0, 0xff, 0xff]);
    }
    Ok(out)
}

/// Deflates bytes and sync-flushes, appending to `out`.
fn deflate_run(z: &mut Compress, input: &[u8], out: &mut Vec<u8>) -> io::Result<()> {
    out.reserve(input.len() + input.len() / 16 + 64);
    let start_in = z.total_in();
    loop {
        let consumed = (z.total_in() - start_in) as usize;
        z.compress_vec(&input[consumed..], out, FlushCompress::Sync)
            .map_err(io::Error::other)?;
        if (z.total_in() - start_in) as usize == input.len() && out.len() < out.capacity() {
            return Ok(());
        }
        out.reserve(out.capacity().max(64));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn sample() -> Vec<u8> {
        // Over 20 blocks (and several zstd jobs), partly compressible.
        let mut x: u32 = 1;
        (0..20 * GZIP_BLOCK + 12345)
            .map(|i| {
                x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
                // Blocks 4 to 6 are noise (stored as is), the rest text with some noise.
                let noise = (4 * GZIP_BLOCK..7 * GZIP_BLOCK + 5000).contains(&i);
                if noise || i % 3 == 0 {
                    (x >> 24) as u8
                } else {
                    b'a' + (i % 7) as u8
                }
            })
            .collect()
    }

    fn compress(c: Compression, data: &[u8], threads: usize, chunk: usize) -> Vec<u8> {
        let mut e = Encoder::new(c, Vec::new(), threads).unwrap();
        for piece in data.chunks(chunk) {
            e.write_all(piece).unwrap();
        }
        e.finish().unwrap()
    }

    #[test]
    fn gzip_bytes_do_not_depend_on_threads_or_write_sizes() {
        let data = sample();
        let one = compress(Compression::Gzip, &data, 1, 4096);
        assert_eq!(one, compress(Compression::Gzip, &data, 3, 1 << 20));
        assert_eq!(one, compress(Compression::Gzip, &data, 8, 777));
        let mut back = Vec::new();
        flate2::read::GzDecoder::new(&one[..])
            .read_to_end(&mut back)
            .unwrap();
        assert!(back == data, "gzip round trip");
        assert!(one.len() < data.len() * 3 / 4, "the text compresses");
        assert!(one.len() > 3 * GZIP_BLOCK, "the noise is stored");
    }

    #[test]
    fn zstd_bytes_do_not_depend_on_threads() {
        let data = sample();
        let one = compress(Compression::Zstd, &data, 1, 4096);
        assert_eq!(one, compress(Compression::Zstd, &data, 4, 1 << 16));
        assert_eq!(zstd::decode_all(&one[..]).unwrap(), data);
    }

    #[test]
    fn empty_gzip_is_valid() {
        let z = compress(Compression::Gzip, b"", 2, 1);
        let mut back = Vec::new();
        flate2::read::GzDecoder::new(&z[..])
            .read_to_end(&mut back)
            .unwrap();
        assert!(back.is_empty());
    }
}
