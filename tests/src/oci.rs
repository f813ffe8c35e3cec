//! Helpers for the oci tests: byte snapshots of a folder, and trees compared by what a layer keeps.
use std::collections::BTreeMap;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// One entry of a snapshot: what a byte-for-byte comparison of a folder looks at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Snap {
    Dir,
    File(Vec<u8>),
    Link(PathBuf),
}

/// Every entry under `dir` with its bytes (empty when `dir` does not exist).
pub fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Snap> {
    let mut out = BTreeMap::new();
    if fs::symlink_metadata(dir).is_ok() {
        snap(dir, dir, &mut out);
    }
    out
}

fn snap(root: &Path, dir: &Path, out: &mut BTreeMap<PathBuf, Snap>) {
    for e in fs::read_dir(dir).expect("readable dir") {
        let p = e.expect("readable entry").path();
        let rel = p.strip_prefix(root).expect("under root").to_path_buf();
        let m = fs::symlink_metadata(&p).expect("stat");
        if m.is_dir() {
            out.insert(rel, Snap::Dir);
            snap(root, &p, out);
        } else if m.file_type().is_symlink() {
            out.insert(rel, Snap::Link(fs::read_link(&p).expect("readlink")));
        } else {
            out.insert(rel, Snap::File(fs::read(&p).expect("read")));
        }
    }
}

/// What a layer keeps of one entry: kind, permission bits, bytes or link target, and which
/// other paths share its inode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    pub kind: char,
    pub mode: u32,
    pub bytes: Vec<u8>,
    pub hardlinks: Vec<Vec<u8>>,
}

/// Every entry under `dir` (not `dir` itself), keyed by its relative path's bytes.
pub fn tree(dir: &Path) -> BTreeMap<Vec<u8>, Node> {
    let mut nodes = BTreeMap::new();
    let mut inodes: BTreeMap<(u64, u64), Vec<Vec<u8>>> = BTreeMap::new();
    walk(dir, dir, &mut nodes, &mut inodes);
    for paths in inodes.values().filter(|p| p.len() > 1) {
        for p in paths {
            nodes.get_mut(p).expect("walked").hardlinks = paths.clone();
        }
    }
    nodes
}

fn walk(
    root: &Path,
    dir: &Path,
    nodes: &mut BTreeMap<Vec<u8>, Node>,
    inodes: &mut BTreeMap<(u64, u64), Vec<Vec<u8>>>,
) {
    for e in fs::read_dir(dir).expect("readable dir") {
        let p = e.expect("readable entry").path();
        let rel = p
            .strip_prefix(root)
            .expect("under root")
            .as_os_str()
            .as_bytes()
            .to_vec();
        let m = fs::symlink_metadata(&p).expect("stat");
        let (kind, mode, bytes) = if m.is_dir() {
            ('d', m.mode() & 0o7777, Vec::new())
        } else if m.file_type().is_symlink() {
            (
                'l',
                0,
                fs::read_link(&p)
                    .expect("readlink")
                    .as_os_str()
                    .as_bytes()
                    .to_vec(),
            )
        } else {
            inodes
                .entry((m.dev(), m.ino()))
                .or_default()
                .push(rel.clone());
            ('f', m.mode() & 0o7777, fs::read(&p).expect("read"))
        };
        nodes.insert(
            rel,
            Node {
                kind,
                mode,
                bytes,
                hardlinks: Vec::new(),
            },
        );
        if kind == 'd' {
            walk(root, &p, nodes, inodes);
        }
    }
}

/// Copies a folder of plain files and directories (the committed fixtures) to `to`.
pub fn copy_tree(from: &Path, to: &Path) {
    fs::create_dir_all(to).expect("mkdir");
    let mut entries: Vec<_> = fs::read_dir(from)
        .expect("readable dir")
        .map(|e| e.expect("entry").path())
        .collect();
    entries.sort();
    for p in entries {
        let dest = to.join(p.file_name().expect("named"));
        if p.is_dir() {
            copy_tree(&p, &dest);
        } else {
            fs::copy(&p, &dest).expect("copy");
        }
    }
}

/// The workspace root (tests/ is one level below it).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ is in the workspace")
        .to_path_buf()
}
