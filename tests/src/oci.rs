//! Helpers for the oci tests: the `oci` command cut off from the host's credentials, byte
//! snapshots of a folder, trees compared by what a layer keeps, and a plain-HTTP client that reads
//! and writes a registry's manifests and blobs by hand (an independent client, not oci's own).
use sha2::Digest as _;
use std::collections::BTreeMap;
use std::fs;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The `oci` binary with `args`, its credential sources (`$OCI_CREDS`, the auth file, Docker's
/// config) pointed nowhere, so a test gets only what its flags give.
pub fn cli(args: &[&str]) -> Command {
    let mut c = crate::cmd("oci");
    c.args(args)
        .env_remove("OCI_CREDS")
        .env("REGISTRY_AUTH_FILE", "/nonexistent-auth.json")
        .env("DOCKER_CONFIG", "/nonexistent");
    c
}

/// Every manifest media type a registry may answer with, for `Accept`.
pub const MANIFEST_ACCEPT: &str = "application/vnd.oci.image.manifest.v1+json, application/vnd.oci.image.index.v1+json, application/vnd.docker.distribution.manifest.v2+json, application/vnd.docker.distribution.manifest.list.v2+json";

/// `sha256:` and the hex SHA-256 of `bytes`.
pub fn sha256_digest(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(sha2::Sha256::digest(bytes)))
}

/// An HTTP answer read off a `Connection: close` exchange.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Reply {
    /// The first header of that name (any case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The body as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }
}

/// One HTTP/1.1 request over plain TCP (`Connection: close`); its answer, a chunked body decoded.
pub fn http(
    addr: SocketAddr,
    method: &str,
    target: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Reply {
    let mut conn = TcpStream::connect(addr).expect("the registry listens");
    conn.set_read_timeout(Some(std::time::Duration::from_secs(60)))
        .expect("can set a timeout");
    let mut req = format!(
        "{method} {target} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    for (k, v) in headers {
        req += &format!("{k}: {v}\r\n");
    }
    req += "\r\n";
    conn.write_all(req.as_bytes()).expect("can send the head");
    conn.write_all(body).expect("can send the body");
    let mut raw = Vec::new();
    conn.read_to_end(&mut raw).expect("can read the answer");
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no head in {:?}", String::from_utf8_lossy(&raw)));
    let head = String::from_utf8(raw[..split].to_vec()).expect("an ASCII head");
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .expect("a status line");
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.to_string(), v.trim().to_string()))
        .collect();
    let mut reply = Reply {
        status,
        headers,
        body: raw[split + 4..].to_vec(),
    };
    if reply
        .header("transfer-encoding")
        .is_some_and(|t| t.eq_ignore_ascii_case("chunked"))
    {
        reply.body = dechunk(&reply.body);
    }
    reply
}

/// A chunked body's bytes.
fn dechunk(mut raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let eol = raw
            .windows(2)
            .position(|w| w == b"\r\n")
            .expect("a chunk size line");
        let size = std::str::from_utf8(&raw[..eol]).expect("ASCII");
        let size = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16)
            .expect("a hex chunk size");
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&raw[eol + 2..eol + 2 + size]);
        raw = &raw[eol + 2 + size + 2..];
    }
}

/// Uploads `bytes` as a blob of `repo` (a POST, then one PUT); returns its digest.
pub fn push_blob(addr: SocketAddr, repo: &str, bytes: &[u8]) -> String {
    let digest = sha256_digest(bytes);
    let r = http(
        addr,
        "POST",
        &format!("/v2/{repo}/blobs/uploads/"),
        &[],
        b"",
    );
    assert_eq!(r.status, 202, "{}", String::from_utf8_lossy(&r.body));
    let location = r.header("location").expect("an upload location");
    let path = match location.strip_prefix("http://") {
        Some(rest) => &rest[rest.find('/').expect("a path")..],
        None => location,
    };
    let sep = if path.contains('?') { '&' } else { '?' };
    let r = http(
        addr,
        "PUT",
        &format!("{path}{sep}digest={digest}"),
        &[("Content-Type", "application/octet-stream")],
        bytes,
    );
    assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
    digest
}

/// Puts `bytes` as a manifest of `media_type` under `reference` (a tag or digest) of `repo`;
/// returns its digest, which the registry must echo.
pub fn put_manifest(
    addr: SocketAddr,
    repo: &str,
    reference: &str,
    media_type: &str,
    bytes: &[u8],
) -> String {
    let digest = sha256_digest(bytes);
    let r = http(
        addr,
        "PUT",
        &format!("/v2/{repo}/manifests/{reference}"),
        &[("Content-Type", media_type)],
        bytes,
    );
    assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.header("docker-content-digest"), Some(digest.as_str()));
    digest
}

/// The exact bytes of the manifest under `reference` of `repo`, or `None` when the registry has
/// none there (404).
pub fn get_manifest(addr: SocketAddr, repo: &str, reference: &str) -> Option<Vec<u8>> {
    let r = http(
        addr,
        "GET",
        &format!("/v2/{repo}/manifests/{reference}"),
        &[("Accept", MANIFEST_ACCEPT)],
        b"",
    );
    match r.status {
        200 => Some(r.body),
        404 => None,
        s => panic!(
            "GET {repo}:{reference} answered {s}: {}",
            String::from_utf8_lossy(&r.body)
        ),
    }
}

/// The bytes of a blob of `repo`.
pub fn get_blob(addr: SocketAddr, repo: &str, digest: &str) -> Vec<u8> {
    let r = http(addr, "GET", &format!("/v2/{repo}/blobs/{digest}"), &[], b"");
    assert_eq!(r.status, 200, "GET blob {digest} of {repo}");
    assert_eq!(
        sha256_digest(&r.body),
        digest,
        "the blob is what its digest says"
    );
    r.body
}

/// The tags of `repo`, sorted (none when the repository is unknown).
pub fn tags(addr: SocketAddr, repo: &str) -> Vec<String> {
    let r = http(addr, "GET", &format!("/v2/{repo}/tags/list"), &[], b"");
    if r.status == 404 {
        return Vec::new();
    }
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let mut tags: Vec<String> = r.json()["tags"]
        .as_array()
        .map(|t| {
            t.iter()
                .filter_map(|t| t.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    tags.sort();
    tags
}

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
