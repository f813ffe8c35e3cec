//! A new file written past the page cache (`O_DIRECT`) where the filesystem allows it. A GiB
//! written through the cache on a machine whose memory is full of cache cost up to 3.4 s of the
//! kernel's time finding pages (0.4 s when memory was free), and two such writes at once (an
//! import and its copy on another coordinator) did not overlap; written direct, each goes at the
//! disk's speed, whatever the cache holds. Whole blocks go direct; the tail after the last one
//! goes through the cache, and [`DirectWriter::finish`] syncs it all.
use rustix::fs::OFlags;
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// What a direct write's buffer, offset and length must be a multiple of (the largest logical
/// block size in use).
const ALIGN: usize = 4096;
/// Bytes gathered before each direct write.
const BLOCK: usize = 1 << 20;

/// Writes a new file, direct where it can (see the module's doc).
pub struct DirectWriter {
    file: File,
    /// BLOCK bytes at an ALIGN boundary, inside an allocation ALIGN larger.
    space: Vec<u8>,
    start: usize,
    len: usize,
    direct: bool,
}

impl DirectWriter {
    /// Creates `path` (which must not exist).
    pub fn create(path: &Path) -> io::Result<DirectWriter> {
        let mut options = OpenOptions::new();
        options.write(true).create_new(true);
        let direct = options
            .clone()
            .custom_flags(OFlags::DIRECT.bits() as i32)
            .open(path);
        let (file, direct) = match direct {
            Ok(file) => (file, true),
            // A filesystem without direct writes (tmpfs) refuses the flag.
            Err(e) if e.raw_os_error() == Some(EINVAL) => (options.open(path)?, false),
            Err(e) => return Err(e),
        };
        let space = vec![0u8; BLOCK + ALIGN];
        let start = space.as_ptr().align_offset(ALIGN);
        Ok(DirectWriter {
            file,
            space,
            start,
            len: 0,
            direct,
        })
    }

    /// Writes what is gathered, syncs the file and closes it.
    pub fn finish(mut self) -> io::Result<()> {
        let whole = self.len / ALIGN * ALIGN;
        self.write_out(whole)?;
        if self.len > 0 {
            self.go_through_cache()?;
            self.write_out(self.len)?;
        }
        self.file.sync_all()
    }

    /// Writes the first `n` gathered bytes and keeps the rest at the start.
    fn write_out(&mut self, n: usize) -> io::Result<()> {
        let block = self.start..self.start + n;
        match self.file.write_all(&self.space[block.clone()]) {
            Ok(()) => {}
            // A device that wants another alignment: the rest goes through the cache.
            Err(e) if self.direct && e.raw_os_error() == Some(EINVAL) => {
                self.go_through_cache()?;
                self.file.write_all(&self.space[block])?;
            }
            Err(e) => return Err(e),
        }
        self.space
            .copy_within(self.start + n..self.start + self.len, self.start);
        self.len -= n;
        Ok(())
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

impl Write for DirectWriter {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        let n = data.len().min(BLOCK - self.len);
        let at = self.start + self.len;
        self.space[at..at + n].copy_from_slice(&data[..n]);
        self.len += n;
        if self.len == BLOCK {
            self.write_out(BLOCK)?;
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
    fn an_existing_file_is_not_written_over() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, b"kept").unwrap();
        assert!(DirectWriter::create(&path).is_err());
        assert_eq!(std::fs::read(&path).unwrap(), b"kept");
    }
}
