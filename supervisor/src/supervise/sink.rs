//! One output stream of a run: keeps the first `limit` bytes in its file, counts and hashes
//! everything, remembers the last bytes, and never stops reading (the program is never blocked).
use run_store::{Bytes, StreamRecord};
use run_store::{Digest, describe_io};
use sha2::{Digest as _, Sha256};
use std::fs::File;
use std::io::{self, Read, Write};

/// How many of the last bytes a record keeps.
pub const LAST_BYTES: usize = 1024;

pub struct Sink {
    /// None once the pipe reached end of file.
    pub pipe: Option<File>,
    file: Option<File>,
    limit: u64,
    bytes: u64,
    kept: u64,
    hasher: Sha256,
    last: Vec<u8>,
    write_error: Option<String>,
}

impl Sink {
    pub fn new(pipe: File, file: File, limit: u64) -> Self {
        Self {
            pipe: Some(pipe),
            file: Some(file),
            limit,
            bytes: 0,
            kept: 0,
            hasher: Sha256::new(),
            last: Vec::with_capacity(2 * LAST_BYTES),
            write_error: None,
        }
    }

    /// Reads what the pipe holds now (it was reported readable, so this does not block).
    pub fn read_once(&mut self, buf: &mut [u8]) {
        let Some(pipe) = self.pipe.as_mut() else {
            return;
        };
        match pipe.read(buf) {
            Ok(0) => self.pipe = None,
            Ok(n) => self.push(&buf[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => self.pipe = None,
        }
    }

    fn push(&mut self, data: &[u8]) {
        self.bytes += data.len() as u64;
        self.hasher.update(data);
        if data.len() >= LAST_BYTES {
            self.last.clear();
            self.last
                .extend_from_slice(&data[data.len() - LAST_BYTES..]);
        } else {
            self.last.extend_from_slice(data);
            if self.last.len() > LAST_BYTES {
                self.last.drain(..self.last.len() - LAST_BYTES);
            }
        }
        let room = self.limit.saturating_sub(self.kept).min(data.len() as u64) as usize;
        if room == 0 {
            return;
        }
        if let Some(file) = self.file.as_mut() {
            match file.write_all(&data[..room]) {
                Ok(()) => self.kept += room as u64,
                Err(e) => {
                    // A full disk must not stop the run: keep counting, stop keeping.
                    self.write_error = Some(describe_io(&e));
                    self.file = None;
                }
            }
        }
    }

    pub fn record(self) -> StreamRecord {
        StreamRecord {
            bytes: self.bytes,
            kept: self.kept,
            truncated: self.kept < self.bytes,
            sha256: Digest::from_hasher(self.hasher).to_string(),
            last: Bytes(self.last),
            write_error: self.write_error,
        }
    }
}
