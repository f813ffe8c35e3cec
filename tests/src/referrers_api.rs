//! A stand-in for a registry that implements the OCI 1.1 referrers API (distribution 2.8 does
//! not, and none that does can be installed here): a loopback proxy in front of a real
//! [`Registry`] that forwards every request to it, except that it
//!
//! - answers `GET /v2/<name>/referrers/<digest>[?artifactType=<type>]` itself, as the OCI
//!   distribution spec 1.1 ("Listing Referrers") says a registry does: `200` with an image index
//!   of the descriptors of every manifest in `<name>` whose `subject.digest` is `<digest>` (an
//!   empty `manifests` when there are none), each with its `artifactType` (the manifest's own, or
//!   else its config's `mediaType`) and its `annotations`, in the order of their digests; with
//!   `?artifactType=` only those of that type, and the header `OCI-Filters-Applied: artifactType`.
//!   It finds them by reading the registry's storage on disk ([`Registry::storage`]);
//! - adds `OCI-Subject: <subject digest>` to the registry's `201 Created` for a manifest pushed
//!   with a `subject` ("Pushing Manifests with Subject"): that is how a registry tells a client it
//!   indexes referrers, so that the client does not maintain the fallback tag `sha256-<hex>`.
//!
//! Being a stand-in, it holds nothing of its own: the real registry stores and checks every
//! manifest and blob, and answers everything else (`GET /v2/` included). It does not check
//! credentials before answering a referrers query (front a registry without auth), never pages
//! its answer (no `Link`), knows only `sha256` manifests, speaks plain HTTP (front a plain
//! registry), and takes one request per connection (`Connection: close`), like
//! [`FaultProxy`](crate::registry::FaultProxy). It decodes `?artifactType=` as a Go registry's
//! `url.ParseQuery` does: `%XX` escapes, and `+` is a space, so a client sends the `+` of a media
//! type as `%2B`.
use crate::registry::{Loopback, Registry, RequestHead};
use serde_json::{Map, Value, json};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::{Arc, Mutex};

/// The media type of an OCI image index, which a referrers answer is.
pub const INDEX_MEDIA_TYPE: &str = "application/vnd.oci.image.index.v1+json";
/// The media type of an OCI image manifest.
pub const MANIFEST_MEDIA_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
const DOCKER_LIST_MEDIA_TYPE: &str = "application/vnd.docker.distribution.manifest.list.v2+json";

/// The stand-in (see the module): a loopback proxy in front of a plain [`Registry`] that adds
/// the OCI 1.1 referrers API. It stops listening when dropped; the registry must outlive it.
pub struct ReferrersApi {
    pub addr: SocketAddr,
    queries: Arc<Mutex<Vec<String>>>,
    _loopback: Loopback,
}

impl ReferrersApi {
    /// Starts the stand-in on `127.0.0.1:0` in front of `registry`.
    pub fn start(registry: &Registry) -> ReferrersApi {
        let (upstream, storage) = (registry.addr, registry.storage());
        let queries = Arc::new(Mutex::new(Vec::new()));
        let q = queries.clone();
        let loopback = Loopback::serve(move |conn| serve_one(conn, upstream, &storage, &q));
        ReferrersApi {
            addr: loopback.addr,
            queries,
            _loopback: loopback,
        }
    }

    /// `127.0.0.1:PORT` of the stand-in.
    pub fn host(&self) -> String {
        self.addr.to_string()
    }

    /// `docker://127.0.0.1:PORT/REPO` through the stand-in.
    pub fn image(&self, repo_and_tag: &str) -> String {
        format!("docker://{}/{repo_and_tag}", self.host())
    }

    /// The request targets (path and query, as sent) of the referrers queries it answered so
    /// far, in order. The registry never sees them, so its log does not list them.
    pub fn queries(&self) -> Vec<String> {
        self.queries.lock().expect("not poisoned").clone()
    }
}

fn serve_one(
    mut client: TcpStream,
    upstream: SocketAddr,
    storage: &Path,
    queries: &Mutex<Vec<String>>,
) -> std::io::Result<()> {
    let mut reader = BufReader::new(client.try_clone()?);
    let Some(head) = RequestHead::read(&mut reader)? else {
        return Ok(());
    };
    let (target, query) = head.path.split_once('?').unwrap_or((&head.path, ""));
    if matches!(head.method.as_str(), "GET" | "HEAD")
        && let Some((name, digest)) = referrers_target(target)
    {
        std::io::copy(&mut (&mut reader).take(head.length), &mut std::io::sink())?;
        queries
            .lock()
            .expect("not poisoned")
            .push(head.path.clone());
        let (status, headers, body) = referrers_answer(storage, name, digest, query);
        let mut out = format!(
            "HTTP/1.1 {status}\r\nContent-Length: {}\r\nDocker-Distribution-API-Version: registry/2.0\r\nConnection: close\r\n",
            body.len()
        );
        for (k, v) in headers {
            out += &format!("{k}: {v}\r\n");
        }
        out += "\r\n";
        client.write_all(out.as_bytes())?;
        if head.method == "GET" {
            client.write_all(&body)?;
        }
        return Ok(());
    }
    let manifest_put = head.method == "PUT" && target.contains("/manifests/");
    if !manifest_put {
        let mut up = head.forward(
            upstream,
            &head.lines[0],
            &mut (&mut reader).take(head.length),
        )?;
        std::io::copy(&mut up, &mut client)?;
        return Ok(());
    }
    // A manifest is small: read it whole to see its subject, then forward it.
    let mut body = Vec::new();
    (&mut reader).take(head.length).read_to_end(&mut body)?;
    let subject = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|m| m["subject"]["digest"].as_str().map(str::to_string));
    let mut up = BufReader::new(head.forward(upstream, &head.lines[0], &mut body.as_slice())?);
    let mut answer = String::new();
    loop {
        let mut line = String::new();
        if up.read_line(&mut line)? == 0 || line == "\r\n" {
            break;
        }
        answer += &line;
    }
    if let Some(subject) = subject
        && answer.split_whitespace().nth(1) == Some("201")
    {
        answer += &format!("OCI-Subject: {subject}\r\n");
    }
    answer += "\r\n";
    client.write_all(answer.as_bytes())?;
    std::io::copy(&mut up, &mut client)?;
    Ok(())
}

/// `(name, digest)` of a referrers path `/v2/<name>/referrers/<digest>`.
fn referrers_target(target: &str) -> Option<(&str, &str)> {
    let (name, digest) = target.strip_prefix("/v2/")?.rsplit_once("/referrers/")?;
    (!name.is_empty() && !digest.contains('/')).then_some((name, digest))
}

/// The status, extra headers and body of the answer to a referrers query.
fn referrers_answer(
    storage: &Path,
    name: &str,
    digest: &str,
    query: &str,
) -> (&'static str, Vec<(&'static str, String)>, Vec<u8>) {
    let invalid = |code: &str, message: &str| {
        let body = json!({"errors": [{"code": code, "message": message, "detail": {}}]});
        (
            "400 Bad Request",
            vec![("Content-Type", "application/json".to_string())],
            serde_json::to_vec(&body).expect("JSON serializes"),
        )
    };
    if !valid_name(name) {
        return invalid("NAME_INVALID", "invalid repository name");
    }
    if !valid_digest(digest) {
        return invalid(
            "DIGEST_INVALID",
            "provided digest did not match uploaded content",
        );
    }
    let filter = query
        .split('&')
        .find_map(|kv| kv.strip_prefix("artifactType="))
        .and_then(query_decode)
        .filter(|t| !t.is_empty());
    let mut manifests = referrers(storage, name, digest);
    let mut headers = vec![("Content-Type", INDEX_MEDIA_TYPE.to_string())];
    if let Some(t) = filter {
        manifests.retain(|d| d["artifactType"].as_str() == Some(&t));
        headers.push(("OCI-Filters-Applied", "artifactType".to_string()));
    }
    let index = json!({
        "schemaVersion": 2,
        "mediaType": INDEX_MEDIA_TYPE,
        "manifests": manifests,
    });
    (
        "200 OK",
        headers,
        serde_json::to_vec(&index).expect("JSON serializes"),
    )
}

/// The descriptors of the manifests in repository `name` whose subject is `digest`, by digest.
fn referrers(storage: &Path, name: &str, digest: &str) -> Vec<Value> {
    let v2 = storage.join("docker/registry/v2");
    let revisions = v2
        .join("repositories")
        .join(name)
        .join("_manifests/revisions/sha256");
    let Ok(entries) = std::fs::read_dir(&revisions) else {
        return vec![];
    };
    let mut hexes: Vec<String> = entries
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|h| is_sha256_hex(h))
        // A deleted manifest loses its link but may keep its folder.
        .filter(|h| revisions.join(h).join("link").is_file())
        .collect();
    hexes.sort();
    hexes
        .iter()
        .filter_map(|hex| {
            let data = v2
                .join("blobs/sha256")
                .join(&hex[..2])
                .join(hex)
                .join("data");
            let bytes = std::fs::read(data).ok()?;
            let manifest: Value = serde_json::from_slice(&bytes).ok()?;
            (manifest["subject"]["digest"].as_str() == Some(digest))
                .then(|| descriptor(&manifest, hex, bytes.len()))
        })
        .collect()
}

/// A referrers answer's descriptor of `manifest` (stored as `sha256:<hex>`, `size` bytes).
fn descriptor(manifest: &Value, hex: &str, size: usize) -> Value {
    let is_index = match manifest["mediaType"].as_str() {
        Some(t) => t == INDEX_MEDIA_TYPE || t == DOCKER_LIST_MEDIA_TYPE,
        None => manifest.get("manifests").is_some(),
    };
    let media_type = manifest["mediaType"].as_str().unwrap_or(if is_index {
        INDEX_MEDIA_TYPE
    } else {
        MANIFEST_MEDIA_TYPE
    });
    let non_empty = |v: &Value| v.as_str().filter(|s| !s.is_empty()).map(str::to_string);
    // The spec: the manifest's artifactType, else (for an image manifest, not an index) its
    // config's media type.
    let artifact_type = non_empty(&manifest["artifactType"])
        .or_else(|| (!is_index).then(|| non_empty(&manifest["config"]["mediaType"]))?);
    let mut d = Map::new();
    d.insert("mediaType".into(), media_type.into());
    d.insert("digest".into(), format!("sha256:{hex}").into());
    d.insert("size".into(), size.into());
    if let Some(t) = artifact_type {
        d.insert("artifactType".into(), t.into());
    }
    if let Some(a) = manifest["annotations"].as_object()
        && !a.is_empty()
    {
        d.insert("annotations".into(), Value::Object(a.clone()));
    }
    Value::Object(d)
}

/// A repository name as the distribution spec allows it: `/`-separated components of lowercase
/// letters and digits joined by `.`, `_`, `__` or runs of `-`.
fn valid_name(name: &str) -> bool {
    name.split('/').all(|c| {
        let alnum = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
        let b = c.as_bytes();
        !b.is_empty()
            && alnum(b[0])
            && alnum(b[b.len() - 1])
            && b.iter()
                .all(|&x| alnum(x) || matches!(x, b'.' | b'_' | b'-'))
            && !c.contains("..")
            && !c.contains("___")
    })
}

/// A digest as the OCI image spec writes one: `algorithm:encoded`, sha256 with 64 hex digits.
fn valid_digest(digest: &str) -> bool {
    let Some((algorithm, encoded)) = digest.split_once(':') else {
        return false;
    };
    let algorithm_ok = !algorithm.is_empty()
        && algorithm
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"+._-".contains(&b));
    let encoded_ok = !encoded.is_empty()
        && encoded
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"=_-".contains(&b));
    algorithm_ok && encoded_ok && (algorithm != "sha256" || is_sha256_hex(encoded))
}

fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// A query value decoded as Go's `url.ParseQuery` does (`%XX`, and `+` as a space); `None` for
/// a malformed escape, which Go drops the parameter for.
fn query_decode(raw: &str) -> Option<String> {
    let mut out = Vec::new();
    let mut bytes = raw.bytes();
    while let Some(b) = bytes.next() {
        match b {
            b'%' => {
                let hex = [bytes.next()?, bytes.next()?];
                let hex = std::str::from_utf8(&hex).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
            }
            b'+' => out.push(b' '),
            b => out.push(b),
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Command, Stdio};

    use crate::oci::{Reply, push_blob};

    /// One exchange with the stand-in, which answers with a length, never chunked.
    fn http(
        addr: SocketAddr,
        method: &str,
        target: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Reply {
        let reply = crate::oci::http(addr, method, target, headers, body);
        assert_ne!(reply.header("transfer-encoding"), Some("chunked"));
        reply
    }

    fn sha256(bytes: &[u8]) -> String {
        let mut child = Command::new("sha256sum")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("sha256sum is installed");
        child
            .stdin
            .take()
            .expect("piped")
            .write_all(bytes)
            .expect("can feed sha256sum");
        let out = child.wait_with_output().expect("sha256sum runs");
        let hex = String::from_utf8(out.stdout).expect("hex");
        format!("sha256:{}", hex.split_whitespace().next().expect("a sum"))
    }

    /// Pushes `manifest` by digest (by `tag` when given); returns its digest, bytes and the reply.
    fn push_manifest(
        addr: SocketAddr,
        repo: &str,
        tag: Option<&str>,
        manifest: &Value,
    ) -> (String, Vec<u8>, Reply) {
        let bytes = serde_json::to_vec(manifest).expect("JSON serializes");
        let digest = sha256(&bytes);
        let reference = tag.unwrap_or(&digest);
        let media_type = manifest["mediaType"].as_str().expect("a media type");
        let r = http(
            addr,
            "PUT",
            &format!("/v2/{repo}/manifests/{reference}"),
            &[("Content-Type", media_type)],
            &bytes,
        );
        assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
        assert_eq!(r.header("docker-content-digest"), Some(digest.as_str()));
        (digest, bytes, r)
    }

    fn index(manifests: Vec<Value>) -> Value {
        json!({"schemaVersion": 2, "mediaType": INDEX_MEDIA_TYPE, "manifests": manifests})
    }

    #[test]
    fn stand_in_lists_referrers_from_the_registry_storage_and_announces_subjects() {
        const SBOM: &str = "application/vnd.example.sbom.v1";
        const SIG_CONFIG: &str = "application/vnd.example.sig.config.v1+json";
        const NOTE: &str = "application/vnd.example.note.v1";
        const EMPTY: &str = "application/vnd.oci.empty.v1+json";
        let registry = Registry::plain();
        let api = ReferrersApi::start(&registry);
        let addr = api.addr;
        assert_eq!(
            api.image("app:v1"),
            format!("docker://{}/app:v1", api.host())
        );

        // Forwarded as the registry answers it.
        let v2 = http(addr, "GET", "/v2/", &[], b"");
        assert_eq!(v2.status, 200);
        assert_eq!(
            v2.header("docker-distribution-api-version"),
            Some("registry/2.0")
        );

        let empty = push_blob(addr, "app", b"{}");
        assert_eq!(
            empty,
            "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"
        );
        let blob = |media_type: &str| json!({"mediaType": media_type, "digest": empty, "size": 2});
        let image = json!({
            "schemaVersion": 2,
            "mediaType": MANIFEST_MEDIA_TYPE,
            "config": blob("application/vnd.oci.image.config.v1+json"),
            "layers": [blob("application/vnd.oci.image.layer.v1.tar")],
        });
        let (image_digest, image_bytes, r) = push_manifest(addr, "app", Some("v1"), &image);
        assert_eq!(r.header("oci-subject"), None, "the image has no subject");
        let subject = json!({
            "mediaType": MANIFEST_MEDIA_TYPE, "digest": image_digest, "size": image_bytes.len(),
        });

        let sbom = json!({
            "schemaVersion": 2,
            "mediaType": MANIFEST_MEDIA_TYPE,
            "artifactType": SBOM,
            "config": blob(EMPTY),
            "layers": [blob(EMPTY)],
            "subject": subject,
            "annotations": {"org.example.kind": "sbom", "org.opencontainers.image.created": "2024-01-01T00:00:00Z"},
        });
        let (sbom_digest, sbom_bytes, r) = push_manifest(addr, "app", None, &sbom);
        assert_eq!(r.header("oci-subject"), Some(image_digest.as_str()));
        // No artifactType: the config's media type stands for it.
        let sig = json!({
            "schemaVersion": 2,
            "mediaType": MANIFEST_MEDIA_TYPE,
            "config": blob(SIG_CONFIG),
            "layers": [blob(EMPTY)],
            "subject": subject,
        });
        let (sig_digest, sig_bytes, r) = push_manifest(addr, "app", None, &sig);
        assert_eq!(r.header("oci-subject"), Some(image_digest.as_str()));
        // A referrer of the SBOM, not of the image.
        let note = json!({
            "schemaVersion": 2,
            "mediaType": MANIFEST_MEDIA_TYPE,
            "artifactType": NOTE,
            "config": blob(EMPTY),
            "layers": [blob(EMPTY)],
            "subject": {"mediaType": MANIFEST_MEDIA_TYPE, "digest": sbom_digest, "size": sbom_bytes.len()},
        });
        let (note_digest, note_bytes, _) = push_manifest(addr, "app", None, &note);
        // A referrer of the same digest in another repository.
        push_blob(addr, "other", b"{}");
        let (other_digest, other_bytes, _) = push_manifest(addr, "other", None, &sig);
        assert_eq!(other_digest, sig_digest);

        let sbom_descriptor = json!({
            "mediaType": MANIFEST_MEDIA_TYPE, "digest": sbom_digest, "size": sbom_bytes.len(),
            "artifactType": SBOM, "annotations": sbom["annotations"],
        });
        let sig_descriptor = json!({
            "mediaType": MANIFEST_MEDIA_TYPE, "digest": sig_digest, "size": sig_bytes.len(),
            "artifactType": SIG_CONFIG,
        });
        let mut both = vec![sbom_descriptor.clone(), sig_descriptor.clone()];
        both.sort_by(|a, b| a["digest"].as_str().cmp(&b["digest"].as_str()));

        let referrers = format!("/v2/app/referrers/{image_digest}");
        let r = http(addr, "GET", &referrers, &[], b"");
        assert_eq!(r.status, 200);
        assert_eq!(r.header("content-type"), Some(INDEX_MEDIA_TYPE));
        assert_eq!(r.header("oci-filters-applied"), None);
        assert_eq!(r.json(), index(both.clone()));
        let head = http(addr, "HEAD", &referrers, &[], b"");
        assert_eq!((head.status, head.body.len()), (200, 0));

        for filtered in [
            format!("{referrers}?artifactType=application%2Fvnd.example.sbom.v1"),
            format!("{referrers}?artifactType={SBOM}"),
        ] {
            let r = http(addr, "GET", &filtered, &[], b"");
            assert_eq!(r.status, 200);
            assert_eq!(r.header("oci-filters-applied"), Some("artifactType"));
            assert_eq!(r.json(), index(vec![sbom_descriptor.clone()]));
        }
        let escaped =
            format!("{referrers}?artifactType=application%2Fvnd.example.sig.config.v1%2Bjson");
        assert_eq!(
            http(addr, "GET", &escaped, &[], b"").json(),
            index(vec![sig_descriptor.clone()])
        );
        let unknown_type = format!("{referrers}?artifactType=application/vnd.example.none");
        let r = http(addr, "GET", &unknown_type, &[], b"");
        assert_eq!(r.status, 200);
        assert_eq!(r.header("oci-filters-applied"), Some("artifactType"));
        assert_eq!(r.json(), index(vec![]));

        let r = http(
            addr,
            "GET",
            &format!("/v2/app/referrers/{sbom_digest}"),
            &[],
            b"",
        );
        assert_eq!(
            r.json(),
            index(vec![json!({
                "mediaType": MANIFEST_MEDIA_TYPE, "digest": note_digest, "size": note_bytes.len(),
                "artifactType": NOTE,
            })])
        );
        let r = http(
            addr,
            "GET",
            &format!("/v2/other/referrers/{image_digest}"),
            &[],
            b"",
        );
        let mut other_descriptor = sig_descriptor.clone();
        other_descriptor["size"] = other_bytes.len().into();
        assert_eq!(r.json(), index(vec![other_descriptor]));

        // Unknown digests and repositories: still 200, with no referrers.
        let unknown = format!("/v2/app/referrers/sha256:{}", "0".repeat(64));
        let r = http(addr, "GET", &unknown, &[], b"");
        assert_eq!(r.status, 200);
        assert_eq!(r.header("content-type"), Some(INDEX_MEDIA_TYPE));
        assert_eq!(r.json(), index(vec![]));
        let r = http(
            addr,
            "GET",
            &format!("/v2/nowhere/referrers/{image_digest}"),
            &[],
            b"",
        );
        assert_eq!((r.status, r.json()), (200, index(vec![])));
        // Malformed digests and names: 400.
        for bad in [
            "/v2/app/referrers/not-a-digest".to_string(),
            "/v2/app/referrers/sha256:abc".to_string(),
            format!("/v2/App/referrers/{image_digest}"),
            format!("/v2/../referrers/{image_digest}"),
        ] {
            assert_eq!(http(addr, "GET", &bad, &[], b"").status, 400, "{bad}");
        }

        // A deleted referrer is no longer listed.
        let r = http(
            addr,
            "DELETE",
            &format!("/v2/app/manifests/{sig_digest}"),
            &[],
            b"",
        );
        assert_eq!(r.status, 202);
        let r = http(addr, "GET", &referrers, &[], b"");
        assert_eq!(r.json(), index(vec![sbom_descriptor]));

        // Everything else reached the registry; the referrers queries did not.
        let pulled = http(
            addr,
            "GET",
            "/v2/app/manifests/v1",
            &[("Accept", MANIFEST_MEDIA_TYPE)],
            b"",
        );
        assert_eq!((pulled.status, pulled.body), (200, image_bytes));
        assert_eq!(registry.count("GET /v2/app/referrers/"), 0);
        assert_eq!(registry.count("PUT /v2/app/manifests/"), 4);
        assert_eq!(api.queries().len(), 15, "{:#?}", api.queries());
        assert_eq!(api.queries()[0], referrers);
    }

    #[test]
    fn query_values_decode_as_go_does() {
        assert_eq!(query_decode("a%2Fb%2Bc").as_deref(), Some("a/b+c"));
        assert_eq!(query_decode("a+b").as_deref(), Some("a b"));
        assert_eq!(query_decode("a%2").as_deref(), None);
        assert!(valid_name("a/b-c/d.e_f"));
        assert!(!valid_name("a//b") && !valid_name("..") && !valid_name("A"));
    }
}
