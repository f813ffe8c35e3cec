//! `tar`: a tar archive, as a layer, a run's folder or an engine's archive holds one.
//!
//! - Read with the `tar` crate (the reader the agent streams an engine's archives through): every
//!   entry's content is at most its declared size, and only the last entry may come short.
//! - Each entry's header written again by `oci`'s own writer ([`oci::local::tar::header`], PAX records
//!   for long and non-UTF-8 names) reads back with the same path, link, kind, mode and size.
//! - Unpacked into a run's folder of a run store (symbolic links pointing anywhere included; the
//!   unpacking itself leaves nothing outside), then every name in the archive, and every link's
//!   target, is opened as a `collect` opens it ([`run_store::inside::open_in_run`]): a file is
//!   opened only if it is a regular file inside the run's folder reached without a symbolic
//!   link, and a path with `..` or a leading `/` is refused as leaving the folder.
//! - The unpacked folder walked into a layer by `oci` ([`oci::local::layer::write_layer`]) reads back
//!   as the same tree: names, kinds, contents and link targets.
use crate::support::fresh_dir;
use oci::local::tar::{Entry as OciEntry, Kind};
use run_store::inside::{OpenError, open_in_run};
use run_store::{RunId, Store};
use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsStr;
use std::io::Read;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Component, Path};

/// Entries read from one archive at most.
const MAX_ENTRIES: usize = 64;
const SECRET: &[u8] = b"outside the run folder";

/// One entry as the `tar` crate read it.
struct Read1 {
    path: Vec<u8>,
    link: Option<Vec<u8>>,
    kind: tar::EntryType,
    mode: Option<u32>,
    size: u64,
}

pub fn tar(data: &[u8]) {
    let entries = read_entries(data);
    for e in &entries {
        header_round_trip(e);
    }
    let root = fresh_dir("tar-store");
    let store = Store::new(&root);
    let id = RunId::parse("fuzz").expect("a run id");
    let run_dir = store.run_dir(&id);
    std::fs::create_dir_all(&run_dir).expect("a run folder");
    let outside = root.join("outside");
    std::fs::create_dir(&outside).expect("a folder outside the run");
    std::fs::write(outside.join("secret"), SECRET).expect("a file outside the run");
    unpack(data, &run_dir);
    nothing_outside(&root, &outside);
    let tree = walk(&run_dir);
    let mut asked: BTreeSet<Vec<u8>> = BTreeSet::new();
    for e in &entries {
        asked.insert(e.path.clone());
        if let Some(link) = &e.link {
            asked.insert(link.clone());
        }
    }
    for path in asked.iter().take(2 * MAX_ENTRIES) {
        opened_only_inside(&store, &id, path, &tree);
    }
    layer_round_trip(&run_dir, &tree);
}

fn read_entries(data: &[u8]) -> Vec<Read1> {
    let mut out = Vec::new();
    let mut archive = tar::Archive::new(data);
    let Ok(entries) = archive.entries() else {
        return out;
    };
    let mut short = false;
    for entry in entries.take(MAX_ENTRIES) {
        let Ok(mut e) = entry else { break };
        assert!(!short, "only the last entry of an archive may come short");
        let mut content = Vec::new();
        let read = e.read_to_end(&mut content);
        let size = e.size();
        if read.is_ok() {
            assert!(
                content.len() as u64 <= size,
                "an entry gave more than its size"
            );
            short = (content.len() as u64) < size;
        }
        out.push(Read1 {
            path: e.path_bytes().into_owned(),
            link: e.link_name_bytes().map(|l| l.into_owned()),
            kind: e.header().entry_type(),
            mode: e.header().mode().ok(),
            size,
        });
    }
    out
}

/// `oci`'s header for an entry like this one reads back as it was written.
fn header_round_trip(e: &Read1) {
    let kind = match e.kind {
        tar::EntryType::Regular => Kind::File,
        tar::EntryType::Directory => Kind::Dir,
        tar::EntryType::Symlink => Kind::Symlink,
        tar::EntryType::Link => Kind::Hardlink,
        _ => return,
    };
    let link: &[u8] = match kind {
        Kind::Symlink | Kind::Hardlink => e.link.as_deref().unwrap_or(b""),
        Kind::File | Kind::Dir => b"",
    };
    // A name from a folder is never empty and never holds a NUL; a link always has a target.
    let linked = matches!(kind, Kind::Symlink | Kind::Hardlink);
    if e.path.is_empty() || e.path.contains(&0) || link.contains(&0) || (linked && link.is_empty())
    {
        return;
    }
    let mode = e.mode.unwrap_or(0o644) & 0o7777;
    let size = if kind == Kind::File { e.size } else { 0 };
    let header = oci::local::tar::header(&OciEntry {
        path: &e.path,
        kind,
        mode,
        size,
        link,
        mtime: 0,
    });
    assert_eq!(header.len() % 512, 0, "a header is whole blocks");
    let mut archive = tar::Archive::new(header.as_slice());
    let back = archive
        .entries()
        .expect("entries")
        .next()
        .expect("one entry")
        .expect("oci's header reads back");
    assert_eq!(&*back.path_bytes(), e.path.as_slice(), "path");
    assert_eq!(back.header().entry_type(), e.kind, "kind");
    assert_eq!(back.size(), size, "size");
    assert_eq!(back.header().mode().ok(), Some(mode), "mode");
    if linked {
        assert_eq!(back.link_name_bytes().as_deref(), Some(link), "link");
    }
}

/// The relative path of an archive name if every component is a plain name, and no folder on
/// the way to it inside `dir` is a symbolic link (so this harness never writes through one).
fn safe_target(dir: &Path, name: &[u8]) -> Option<std::path::PathBuf> {
    let rel = Path::new(OsStr::from_bytes(name));
    let mut parts = Vec::new();
    for c in rel.components() {
        match c {
            Component::Normal(p) => parts.push(p),
            Component::CurDir => {}
            _ => return None,
        }
    }
    let (_, folders) = parts.split_last()?;
    let mut at = dir.to_path_buf();
    for f in folders {
        at.push(f);
        match std::fs::symlink_metadata(&at) {
            Ok(m) if m.file_type().is_symlink() => return None,
            _ => {}
        }
    }
    Some(parts.iter().collect())
}

fn unpack(data: &[u8], run_dir: &Path) {
    let mut archive = tar::Archive::new(data);
    let Ok(entries) = archive.entries() else {
        return;
    };
    for entry in entries.take(MAX_ENTRIES) {
        let Ok(mut e) = entry else { break };
        let kind = e.header().entry_type();
        if !matches!(
            kind,
            tar::EntryType::Regular
                | tar::EntryType::Directory
                | tar::EntryType::Symlink
                | tar::EntryType::Link
        ) || e.size() > 1 << 20
        {
            continue;
        }
        if safe_target(run_dir, &e.path_bytes()).is_none() {
            continue;
        }
        if kind == tar::EntryType::Link
            && e.link_name_bytes()
                .is_none_or(|l| safe_target(run_dir, &l).is_none())
        {
            continue;
        }
        e.set_preserve_mtime(false);
        let _ = e.unpack_in(run_dir);
    }
    // Folders stay enterable, whatever mode the archive gave them, so the next input can clear them.
    let mut stack = vec![run_dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let _ = std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755));
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(entry.path());
            }
        }
    }
}

/// The store holds its run folder and the folder outside it, as they were.
fn nothing_outside(root: &Path, outside: &Path) {
    let names = |dir: &Path| -> Vec<std::ffi::OsString> {
        let mut v: Vec<_> = std::fs::read_dir(dir)
            .expect("read a folder")
            .map(|e| e.expect("an entry").file_name())
            .collect();
        v.sort();
        v
    };
    assert_eq!(
        names(root),
        ["outside", "runs"],
        "unpacking wrote outside the run"
    );
    assert_eq!(
        names(&root.join("runs")),
        ["fuzz"],
        "unpacking wrote outside the run"
    );
    assert_eq!(
        names(outside),
        ["secret"],
        "unpacking wrote outside the run"
    );
    assert_eq!(
        std::fs::read(outside.join("secret")).expect("the secret"),
        SECRET
    );
}

/// What the run folder holds, reached without following a symbolic link: relative name to what
/// it is.
#[derive(Debug, PartialEq)]
enum Node {
    File { id: (u64, u64), content: Vec<u8> },
    Dir,
    Symlink(Vec<u8>),
    Other,
}

fn walk(run_dir: &Path) -> BTreeMap<Vec<u8>, Node> {
    let mut out = BTreeMap::new();
    let mut stack = vec![(run_dir.to_path_buf(), Vec::new())];
    while let Some((dir, rel)) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("read a folder").flatten() {
            let mut name = rel.clone();
            if !name.is_empty() {
                name.push(b'/');
            }
            name.extend_from_slice(entry.file_name().as_bytes());
            let path = entry.path();
            let meta = std::fs::symlink_metadata(&path).expect("stat an entry");
            let node = if meta.file_type().is_symlink() {
                let target = std::fs::read_link(&path).expect("read a link");
                Node::Symlink(target.into_os_string().into_vec())
            } else if meta.is_dir() {
                stack.push((path, name.clone()));
                Node::Dir
            } else if meta.is_file() {
                Node::File {
                    id: (meta.dev(), meta.ino()),
                    content: std::fs::read(&path).expect("read a file"),
                }
            } else {
                Node::Other
            };
            out.insert(name, node);
        }
    }
    out
}

fn opened_only_inside(store: &Store, id: &RunId, path: &[u8], tree: &BTreeMap<Vec<u8>, Node>) {
    let rel = OsStr::from_bytes(path);
    let leaves = Path::new(rel).is_absolute()
        || Path::new(rel)
            .components()
            .any(|c| matches!(c, Component::ParentDir | Component::RootDir));
    match open_in_run(store, id, rel) {
        Ok(file) => {
            assert!(!leaves, "{rel:?} leaves the run folder, yet it was opened");
            let meta = file.metadata().expect("stat the opened file");
            let inside = tree
                .values()
                .any(|n| matches!(n, Node::File { id, .. } if *id == (meta.dev(), meta.ino())));
            assert!(
                inside,
                "{rel:?} opened a file that is not inside the run folder"
            );
        }
        Err(OpenError::Escapes(line)) => assert!(line.contains("leaves the run folder"), "{line}"),
        Err(e) => {
            assert!(
                !leaves,
                "{rel:?} leaves the run folder, yet was refused for another reason: {e}"
            );
        }
    }
}

/// The run folder as a layer, read back: the same names, kinds, contents and link targets.
fn layer_round_trip(run_dir: &Path, tree: &BTreeMap<Vec<u8>, Node>) {
    if tree.values().any(|n| *n == Node::Other) {
        return;
    }
    let mut layer = Vec::new();
    if let Err(e) = oci::local::layer::write_layer(run_dir, &[], 0, None, &mut layer) {
        panic!("a folder of files, folders and links did not become a layer: {e}");
    }
    let mut archive = tar::Archive::new(layer.as_slice());
    let mut read: BTreeMap<Vec<u8>, Node> = BTreeMap::new();
    let mut contents: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
    for entry in archive.entries().expect("a layer's entries") {
        let mut e = entry.expect("a layer's entry reads");
        let mut name = e.path_bytes().into_owned();
        if name.last() == Some(&b'/') {
            name.pop();
        }
        let node = match e.header().entry_type() {
            tar::EntryType::Regular => {
                let mut content = Vec::new();
                e.read_to_end(&mut content).expect("a file's content");
                contents.insert(name.clone(), content.clone());
                Node::File {
                    id: (0, 0),
                    content,
                }
            }
            tar::EntryType::Link => {
                let first = e
                    .link_name_bytes()
                    .expect("a hard link names its first")
                    .into_owned();
                let content = contents
                    .get(&first)
                    .expect("a hard link follows its first")
                    .clone();
                Node::File {
                    id: (0, 0),
                    content,
                }
            }
            tar::EntryType::Directory => Node::Dir,
            tar::EntryType::Symlink => Node::Symlink(
                e.link_name_bytes()
                    .expect("a symlink's target")
                    .into_owned(),
            ),
            other => panic!("a layer holds a {other:?}"),
        };
        assert!(read.insert(name, node).is_none(), "a name twice in a layer");
    }
    let expected: BTreeMap<Vec<u8>, Node> = tree
        .iter()
        .map(|(k, n)| {
            let n = match n {
                Node::File { content, .. } => Node::File {
                    id: (0, 0),
                    content: content.clone(),
                },
                Node::Dir => Node::Dir,
                Node::Symlink(t) => Node::Symlink(t.clone()),
                Node::Other => Node::Other,
            };
            (k.clone(), n)
        })
        .collect();
    assert_eq!(read, expected, "the layer is not the folder");
}
