//! Reproducible tar headers: ustar with PAX records for long or non-UTF-8 names and sizes of 8 GiB and more.
//!
//! Every field that could carry host state is fixed: owner and group 0 with no names, one mtime
//! for all entries, no device numbers, permission bits only.

/// The two zero blocks that end an archive.
pub const END_OF_ARCHIVE: [u8; 1024] = [0; 1024];

/// The largest size the ustar octal field holds (8 GiB - 1); larger sizes go to PAX and base-256.
const MAX_OCTAL_SIZE: u64 = 0o77777777777;

/// The largest mtime the ustar octal field holds.
pub const MAX_MTIME: u64 = 0o77777777777;

/// The name of every PAX extended header; fixed so the archive never depends on the writer's pid.
const PAX_NAME: &[u8] = b"././@PaxHeader";

/// What kind of entry a header introduces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A regular file; its `size` bytes follow the header, padded to 512.
    File,
    /// A directory (its name ends with `/`).
    Dir,
    /// A symbolic link to `link`.
    Symlink,
    /// A hard link to the earlier entry named `link`.
    Hardlink,
}

/// One archive entry's header, as it is written.
#[derive(Debug, Clone)]
pub struct Entry<'a> {
    /// The path inside the archive: relative, `/`-separated, ending with `/` for a directory.
    pub path: &'a [u8],
    /// The entry's kind.
    pub kind: Kind,
    /// Permission bits (`mode & 0o7777`).
    pub mode: u32,
    /// The content size (0 for everything but files).
    pub size: u64,
    /// The link target for symlinks and hardlinks.
    pub link: &'a [u8],
    /// The one mtime every entry gets.
    pub mtime: u64,
}

/// The bytes of an entry's header: a PAX extended header when needed, then the ustar header.
/// The result is a whole number of 512-byte blocks.
pub fn header(entry: &Entry) -> Vec<u8> {
    let mut records = Vec::new();
    let non_utf8 =
        std::str::from_utf8(entry.path).is_err() || std::str::from_utf8(entry.link).is_err();
    if non_utf8 {
        // POSIX: path values are UTF-8 unless hdrcharset says they are raw bytes.
        pax_record(&mut records, b"hdrcharset", b"BINARY");
    }
    if entry.link.len() > 100 || (non_utf8 && !entry.link.is_empty()) {
        pax_record(&mut records, b"linkpath", entry.link);
    }
    if entry.path.len() > 100 || non_utf8 {
        pax_record(&mut records, b"path", entry.path);
    }
    if entry.size > MAX_OCTAL_SIZE {
        pax_record(&mut records, b"size", entry.size.to_string().as_bytes());
    }
    let mut out = Vec::with_capacity(512 * 3);
    if !records.is_empty() {
        let pax = ustar(
            &Entry {
                path: PAX_NAME,
                kind: Kind::File,
                mode: 0o644,
                size: records.len() as u64,
                link: b"",
                mtime: entry.mtime,
            },
            b'x',
        );
        out.extend_from_slice(&pax);
        out.extend_from_slice(&records);
        out.resize(out.len() + padding(records.len() as u64), 0);
    }
    let flag = match entry.kind {
        Kind::File => b'0',
        Kind::Hardlink => b'1',
        Kind::Symlink => b'2',
        Kind::Dir => b'5',
    };
    out.extend_from_slice(&ustar(entry, flag));
    out
}

/// The zero bytes that pad `size` content bytes to a 512-byte boundary.
pub fn padding(size: u64) -> usize {
    ((512 - size % 512) % 512) as usize
}

fn ustar(entry: &Entry, flag: u8) -> [u8; 512] {
    let mut h = [0u8; 512];
    // Fields that do not fit are carried by the PAX header; ustar keeps a truncated copy.
    copy_truncated(&mut h[0..100], entry.path);
    octal(&mut h[100..108], u64::from(entry.mode & 0o7777));
    octal(&mut h[108..116], 0);
    octal(&mut h[116..124], 0);
    if entry.size > MAX_OCTAL_SIZE {
        // GNU base-256: high bit set, big-endian value in the rest of the field.
        h[124] = 0x80;
        h[124 + 4..136].copy_from_slice(&entry.size.to_be_bytes());
    } else {
        octal(&mut h[124..136], entry.size);
    }
    octal(&mut h[136..148], entry.mtime.min(MAX_MTIME));
    h[156] = flag;
    copy_truncated(&mut h[157..257], entry.link);
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    octal(&mut h[329..337], 0);
    octal(&mut h[337..345], 0);
    h[148..156].fill(b' ');
    let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
    let field = format!("{sum:06o}\0 ");
    h[148..156].copy_from_slice(field.as_bytes());
    h
}

fn copy_truncated(field: &mut [u8], value: &[u8]) {
    let n = value.len().min(field.len());
    field[..n].copy_from_slice(&value[..n]);
}

/// Zero-padded octal digits followed by a NUL, filling the field.
fn octal(field: &mut [u8], value: u64) {
    let n = field.len() - 1;
    field[..n].copy_from_slice(format!("{value:0n$o}").as_bytes());
    field[n] = 0;
}

/// Appends `"<len> key=value\n"`, where len counts the whole record including its own digits.
fn pax_record(out: &mut Vec<u8>, key: &[u8], value: &[u8]) {
    let rest = key.len() + value.len() + 3;
    let mut len = rest + 1;
    while len != rest + len.to_string().len() {
        len = rest + len.to_string().len();
    }
    out.extend_from_slice(len.to_string().as_bytes());
    out.push(b' ');
    out.extend_from_slice(key);
    out.push(b'=');
    out.extend_from_slice(value);
    out.push(b'\n');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(path: &[u8], size: u64) -> Entry<'_> {
        Entry {
            path,
            kind: Kind::File,
            mode: 0o644,
            size,
            link: b"",
            mtime: 0,
        }
    }

    #[test]
    fn short_names_get_one_plain_ustar_block() {
        let h = header(&file(b"etc/hosts", 12));
        assert_eq!(h.len(), 512);
        assert_eq!(&h[0..9], b"etc/hosts");
        assert_eq!(&h[124..136], b"00000000014\0");
        assert_eq!(&h[257..265], b"ustar\x0000");
        assert_eq!(&h[265..329], &[0u8; 64][..], "no user or group names");
    }

    #[test]
    fn pax_record_lengths_count_themselves() {
        let mut out = Vec::new();
        pax_record(&mut out, b"path", &[b'a'; 92]);
        assert_eq!(&out[..4], b"102 ");
        assert_eq!(out.len(), 102);
    }

    #[test]
    fn sizes_past_8_gib_use_pax_and_base_256() {
        let size = 8 * (1 << 30) + (1 << 29);
        let h = header(&file(b"big", size));
        assert_eq!(h.len(), 512 * 3);
        assert_eq!(h[156], b'x');
        let records = String::from_utf8_lossy(&h[512..1024]);
        assert!(
            records.starts_with(&format!("19 size={size}\n")),
            "{records}"
        );
        let main = &h[1024..];
        assert_eq!(main[124], 0x80);
        assert_eq!(u64::from_be_bytes(main[128..136].try_into().unwrap()), size);
        // An independent reader agrees. (A real 8.5 GiB file is too slow to stream in CI, even sparse.)
        let mut archive = ::tar::Archive::new(&h[..]);
        let entry = archive.entries().unwrap().next().unwrap().unwrap();
        assert_eq!(entry.path().unwrap().to_str(), Some("big"));
        assert_eq!(entry.header().entry_size().unwrap(), size);
        assert_eq!(entry.size(), size);
    }

    #[test]
    fn long_and_non_utf8_names_are_kept_in_pax() {
        let long = vec![b'n'; 150];
        let h = header(&file(&long, 0));
        assert!(String::from_utf8_lossy(&h[512..1024]).starts_with("160 path=nnn"));
        let h = header(&Entry {
            path: b"caf\xe9",
            kind: Kind::Symlink,
            mode: 0o777,
            size: 0,
            link: b"x\xff",
            mtime: 0,
        });
        let records = &h[512..1024];
        assert!(records.starts_with(b"21 hdrcharset=BINARY\n15 linkpath=x\xff\n13 path=caf\xe9\n"));
    }
}
