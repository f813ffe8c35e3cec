//! One reproducible layer tar from a folder: a sorted walk, fixed metadata, hardlinks as links, special files refused.
use crate::local::tar::{self, Entry, Kind};
use sha1::Sha1;
use sha2::{Digest as _, Sha256};
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

/// A regular file as the layer holds it (what an SBOM lists), recorded during the walk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerFile {
    /// The archive name (prefix included, no leading `/`).
    pub path: Vec<u8>,
    /// Permission bits (`mode & 0o7777`).
    pub mode: u32,
    /// The content size; a hardlink gets that of the file holding its data.
    pub size: u64,
    /// The content's SHA-1.
    pub sha1: [u8; 20],
    /// The content's SHA-256.
    pub sha256: [u8; 32],
}

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
    write_layer_listing(root, prefix, mtime, skip, out, None)
}

/// [`write_layer`], also recording into `files` every regular file the layer holds (hardlinks
/// each under their own name), in archive order, with hashes taken as the bytes stream by.
pub fn write_layer_listing<W: Write>(
    root: &Path,
    prefix: &[Vec<u8>],
    mtime: u64,
    skip: Option<(u64, u64)>,
    out: &mut W,
    files: Option<&mut Vec<LayerFile>>,
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
        files,
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
    /// The archive name of the first file seen for each (device, inode) with more than one link,
    /// and its place in `files` when they are recorded.
    first_links: HashMap<(u64, u64), (Vec<u8>, usize)>,
    buf: Vec<u8>,
    /// The regular files written so far, when asked for.
    files: Option<&'a mut Vec<LayerFile>>,
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
                if let Some((first, at)) = self.first_links.get(&key) {
                    let (first, at) = (first.clone(), *at);
                    self.header(name, Kind::Hardlink, mode, 0, &first)?;
                    if let Some(files) = self.files.as_deref_mut() {
                        // The first name's bytes under another name: listed as a file of its own.
                        // `at` is where the first name was pushed (a failed read ends the walk).
                        let data = files[at].clone();
                        files.push(LayerFile {
                            path: name.clone(),
                            mode,
                            ..data
                        });
                    }
                    return Ok(());
                }
                let at = self.files.as_deref().map_or(0, Vec::len);
                self.first_links.insert(key, (name.clone(), at));
            }
            self.header(name, Kind::File, mode, meta.len(), b"")?;
            let hashes = self.contents(path, meta.len())?;
            if let (Some(files), Some((sha1, sha256))) = (self.files.as_deref_mut(), hashes) {
                files.push(LayerFile {
                    path: name.clone(),
                    mode,
                    size: meta.len(),
                    sha1,
                    sha256,
                });
            }
            Ok(())
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
    /// Returns the content's SHA-1 and SHA-256 when files are recorded.
    fn contents(&mut self, path: &Path, size: u64) -> Result<Option<([u8; 20], [u8; 32])>> {
        let mut hashers = self.files.is_some().then(|| (Sha1::new(), Sha256::new()));
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
            if let Some((sha1, sha256)) = &mut hashers {
                sha1.update(&self.buf[..n]);
                sha256.update(&self.buf[..n]);
            }
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
            .map_err(LayerError::Write)?;
        Ok(hashers.map(|(sha1, sha256)| (sha1.finalize().into(), sha256.finalize().into())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listing_records_regular_files_and_changes_no_byte() {
        let tmp = tempfile::tempdir().unwrap();
        fs::create_dir(tmp.path().join("d")).unwrap();
        fs::write(tmp.path().join("d/a"), b"abc").unwrap();
        fs::hard_link(tmp.path().join("d/a"), tmp.path().join("z")).unwrap();
        std::os::unix::fs::symlink("d/a", tmp.path().join("link")).unwrap();
        let (mut plain, mut listed, mut files) = (Vec::new(), Vec::new(), Vec::new());
        write_layer(tmp.path(), &[b"p".to_vec()], 0, None, &mut plain).unwrap();
        write_layer_listing(
            tmp.path(),
            &[b"p".to_vec()],
            0,
            None,
            &mut listed,
            Some(&mut files),
        )
        .unwrap();
        assert_eq!(plain, listed, "the listing changes no byte of the layer");
        let names: Vec<&[u8]> = files.iter().map(|f| f.path.as_slice()).collect();
        assert_eq!(names, [&b"p/d/a"[..], b"p/z"], "no directory, no symlink");
        assert_eq!(files[0].size, 3);
        assert_eq!(
            hex::encode(files[0].sha256),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(
            hex::encode(files[0].sha1),
            "a9993e364706816aba3e25717850c26c9cd0d89d"
        );
        assert_eq!(
            (files[1].size, files[1].sha1, files[1].sha256),
            (files[0].size, files[0].sha1, files[0].sha256),
            "a hardlink is listed with its data's size and sums"
        );
    }

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
