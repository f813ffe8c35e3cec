//! One reproducible layer tar from a folder: a sorted walk, fixed metadata, hardlinks as links, special files refused.
use crate::tar::{self, Entry, Kind};
use std::collections::HashMap;
use std::ffi::OsString;
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

/// Why a folder could not become a layer. Messages name the path involved.
#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    /// A socket, fifo or device.
    #[error("{} is a {kind}: a layer holds only files, directories and symlinks; remove it from the root", .path.display())]
    Special { path: PathBuf, kind: &'static str },
    /// A file grew or shrank between its stat and the end of its read.
    #[error("{} changed while it was read: build from a folder that nothing is writing to", .path.display())]
    Changed { path: PathBuf },
    /// A file whose size says 0 but which reads as more: a pseudo-file such as those under /proc.
    #[error("{} is a pseudo-file (its size reads as 0 but it has contents, as under /proc or /sys): copy what it holds into a regular file in the root", .path.display())]
    Pseudo { path: PathBuf },
    /// Reading the tree failed.
    #[error("cannot read {}: {}", .path.display(), crate::io_detail(.source))]
    Read { path: PathBuf, source: io::Error },
    /// Writing the tar stream failed.
    #[error("cannot write the layer: {0}")]
    Write(#[source] io::Error),
}

type Result<T> = std::result::Result<T, LayerError>;

/// Writes the tar of `root`'s contents, placed under `prefix` (path components, outermost first),
/// with every entry's mtime set to `mtime`. The root itself is stored only as the prefix's last
/// directory; the prefix's parents get mode 0755. The directory `skip` (device, inode), if met, is
/// left out with everything under it.
pub fn write_layer<W: Write>(
    root: &Path,
    prefix: &[Vec<u8>],
    mtime: u64,
    skip: Option<(u64, u64)>,
    out: &mut W,
) -> Result<()> {
    let root_meta = fs::metadata(root).map_err(|source| LayerError::Read {
        path: root.to_path_buf(),
        source,
    })?;
    let mut walker = Walker {
        out,
        mtime,
        skip,
        first_links: HashMap::new(),
        buf: vec![0; 1 << 20],
    };
    let mut name = Vec::new();
    for (i, component) in prefix.iter().enumerate() {
        name.extend_from_slice(component);
        name.push(b'/');
        let mode = if i + 1 == prefix.len() {
            root_meta.mode() & 0o7777
        } else {
            0o755
        };
        walker.header(&name, Kind::Dir, mode, 0, b"")?;
    }
    walker.dir(root, &mut name)?;
    walker
        .out
        .write_all(&tar::END_OF_ARCHIVE)
        .map_err(LayerError::Write)
}

struct Walker<'a, W> {
    out: &'a mut W,
    mtime: u64,
    skip: Option<(u64, u64)>,
    /// The archive name of the first file seen for each (device, inode) with more than one link.
    first_links: HashMap<(u64, u64), Vec<u8>>,
    buf: Vec<u8>,
}

impl<W: Write> Walker<'_, W> {
    fn header(&mut self, name: &[u8], kind: Kind, mode: u32, size: u64, link: &[u8]) -> Result<()> {
        let h = tar::header(&Entry {
            path: name,
            kind,
            mode,
            size,
            link,
            mtime: self.mtime,
        });
        self.out.write_all(&h).map_err(LayerError::Write)
    }

    fn dir(&mut self, dir: &Path, name: &mut Vec<u8>) -> Result<()> {
        let read_err = |source| LayerError::Read {
            path: dir.to_path_buf(),
            source,
        };
        let mut children: Vec<OsString> = fs::read_dir(dir)
            .map_err(read_err)?
            .map(|e| e.map(|e| e.file_name()))
            .collect::<io::Result<_>>()
            .map_err(read_err)?;
        // Byte order of names, whatever the locale or the order the files were created in.
        children.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
        for child in children {
            let path = dir.join(&child);
            let len = name.len();
            name.extend_from_slice(child.as_bytes());
            self.entry(&path, name)?;
            name.truncate(len);
        }
        Ok(())
    }

    fn entry(&mut self, path: &Path, name: &mut Vec<u8>) -> Result<()> {
        let meta = fs::symlink_metadata(path).map_err(|source| LayerError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let ft = meta.file_type();
        let mode = meta.mode() & 0o7777;
        if ft.is_dir() && self.skip == Some((meta.dev(), meta.ino())) {
            Ok(())
        } else if ft.is_dir() {
            name.push(b'/');
            self.header(name, Kind::Dir, mode, 0, b"")?;
            self.dir(path, name)
        } else if ft.is_symlink() {
            let target = fs::read_link(path).map_err(|source| LayerError::Read {
                path: path.to_path_buf(),
                source,
            })?;
            self.header(name, Kind::Symlink, mode, 0, target.as_os_str().as_bytes())
        } else if ft.is_file() {
            if meta.nlink() > 1 {
                let key = (meta.dev(), meta.ino());
                if let Some(first) = self.first_links.get(&key) {
                    let first = first.clone();
                    return self.header(name, Kind::Hardlink, mode, 0, &first);
                }
                self.first_links.insert(key, name.clone());
            }
            self.header(name, Kind::File, mode, meta.len(), b"")?;
            self.contents(path, meta.len())
        } else {
            let kind = if ft.is_socket() {
                "socket"
            } else if ft.is_fifo() {
                "fifo"
            } else if ft.is_block_device() {
                "block device"
            } else {
                "character device"
            };
            Err(LayerError::Special {
                path: path.to_path_buf(),
                kind,
            })
        }
    }

    /// Copies exactly `size` bytes of a file, then its padding; a file of another size is an error.
    fn contents(&mut self, path: &Path, size: u64) -> Result<()> {
        let read_err = |source| LayerError::Read {
            path: path.to_path_buf(),
            source,
        };
        let mut file = File::open(path).map_err(read_err)?;
        let mut left = size;
        while left > 0 {
            let want = left.min(self.buf.len() as u64) as usize;
            let n = match file.read(&mut self.buf[..want]) {
                Ok(0) => {
                    return Err(LayerError::Changed {
                        path: path.to_path_buf(),
                    });
                }
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(read_err(e)),
            };
            self.out
                .write_all(&self.buf[..n])
                .map_err(LayerError::Write)?;
            left -= n as u64;
        }
        if file.read(&mut self.buf[..1]).map_err(read_err)? != 0 {
            let path = path.to_path_buf();
            return Err(if size == 0 {
                LayerError::Pseudo { path }
            } else {
                LayerError::Changed { path }
            });
        }
        let pad = [0u8; 512];
        self.out
            .write_all(&pad[..tar::padding(size)])
            .map_err(LayerError::Write)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn special_files_are_refused_by_path() {
        let tmp = tempfile::tempdir().unwrap();
        let fifo = tmp.path().join("pipe");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from(0o644),
            0,
        )
        .unwrap();
        let e = write_layer(tmp.path(), &[], 0, None, &mut io::sink()).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "{} is a fifo: a layer holds only files, directories and symlinks; remove it from the root",
                fifo.display()
            )
        );
    }
}
