//! Readers and writers that check bytes against a content digest as they stream; the digest
//! itself is the workspace's one `Digest` (fleet-vocab).
use sha2::{Digest as _, Sha256};
use std::io::{self, Read, Write};

pub use fleet_vocab::{Digest, DigestError};

/// A running SHA-256 with a byte count, for bytes that arrive in pieces.
#[derive(Clone, Default)]
pub struct Hasher {
    sha: Sha256,
    len: u64,
}

impl Hasher {
    /// A fresh hasher.
    pub fn new() -> Hasher {
        Hasher::default()
    }

    /// Feeds more bytes.
    pub fn update(&mut self, bytes: &[u8]) {
        self.sha.update(bytes);
        self.len += bytes.len() as u64;
    }

    /// How many bytes went in so far.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether no bytes went in yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The digest and length of everything fed.
    pub fn finish(self) -> (Digest, u64) {
        (Digest::from_hasher(self.sha), self.len)
    }
}

/// A writer that hashes and counts what passes through it to an inner writer.
pub struct DigestWriter<W> {
    inner: W,
    hasher: Hasher,
}

impl<W: Write> DigestWriter<W> {
    /// Wraps a writer.
    pub fn new(inner: W) -> DigestWriter<W> {
        DigestWriter {
            inner,
            hasher: Hasher::new(),
        }
    }

    /// Bytes written so far.
    pub fn len(&self) -> u64 {
        self.hasher.len()
    }

    /// Whether nothing was written yet.
    pub fn is_empty(&self) -> bool {
        self.hasher.is_empty()
    }

    /// The inner writer.
    pub fn get_mut(&mut self) -> &mut W {
        &mut self.inner
    }

    /// The inner writer, the digest and the length of what was written.
    pub fn finish(self) -> (W, Digest, u64) {
        let (digest, len) = self.hasher.finish();
        (self.inner, digest, len)
    }
}

impl<W: Write> Write for DigestWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// The message for bytes that do not match the digest they were asked for.
pub fn mismatch_message(what: &str, expected: &Digest, actual: &Digest, len: u64) -> String {
    format!("{what} {expected} does not match its digest: its {len} bytes hash to {actual}")
}

/// A reader that checks the bytes it yields against an expected digest (and size, when known).
///
/// At end of stream it returns an `InvalidData` error instead of `Ok(0)` when the bytes do not
/// match, so no caller can take unverified bytes for good ones by forgetting a final check.
pub struct VerifyingReader<R> {
    inner: R,
    expected: Digest,
    expected_size: Option<u64>,
    what: String,
    hasher: Hasher,
    verified: bool,
}

impl<R: Read> VerifyingReader<R> {
    /// Wraps a reader; `what` names the bytes in error messages (e.g. `blob`).
    pub fn new(
        inner: R,
        expected: Digest,
        expected_size: Option<u64>,
        what: &str,
    ) -> VerifyingReader<R> {
        VerifyingReader {
            inner,
            expected,
            expected_size,
            what: what.to_string(),
            hasher: Hasher::new(),
            verified: false,
        }
    }

    /// Whether the stream was read to its end and matched.
    pub fn is_verified(&self) -> bool {
        self.verified
    }

    fn error(&self, message: String) -> io::Error {
        io::Error::new(io::ErrorKind::InvalidData, message)
    }
}

impl<R: Read> Read for VerifyingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        if let Some(size) = self.expected_size
            && self.hasher.len() > size
        {
            return Err(self.error(format!(
                "{} {} is longer than its recorded size of {size} bytes",
                self.what, self.expected
            )));
        }
        if n == 0 && !self.verified {
            let (actual, len) = self.hasher.clone().finish();
            if actual != self.expected {
                return Err(self.error(mismatch_message(&self.what, &self.expected, &actual, len)));
            }
            if let Some(size) = self.expected_size
                && len != size
            {
                return Err(self.error(format!(
                    "{} {} has {len} bytes but its descriptor says {size}",
                    self.what, self.expected
                )));
            }
            self.verified = true;
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Parsing and printing a digest are fleet-vocab's, tested there.

    #[test]
    fn verifying_reader_passes_good_bytes_and_fails_bad_ones() {
        let good = Digest::of(b"hello");
        let mut out = Vec::new();
        let mut r = VerifyingReader::new(&b"hello"[..], good, Some(5), "blob");
        io::copy(&mut r, &mut out).unwrap();
        assert!(r.is_verified());
        let mut r = VerifyingReader::new(&b"hellO"[..], good, None, "blob");
        let e = io::copy(&mut r, &mut io::sink()).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "blob {good} does not match its digest: its 5 bytes hash to {}",
                Digest::of(b"hellO")
            )
        );
        let mut r = VerifyingReader::new(&b"hello!"[..], good, Some(5), "blob");
        assert!(io::copy(&mut r, &mut io::sink()).is_err());
    }
}
