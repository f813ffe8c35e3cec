//! Tests: oci_remote. `oci push`, `oci copy` and remote `oci inspect` against real `docker-registry`
//! processes on loopback (plain, TLS with clientcas, htpasswd), with skopeo as the oracle.
use oci::local::layout::Layout;
use oci::types::digest::Digest;
use oci::types::spec::{self, Descriptor, Index, Platform};
use std::path::Path;
use std::process::Command;
use testkit::pki::Pki;
use testkit::registry::{Fault, FaultProxy, Options, Registry};

/// Incompressible bytes from a seed (xorshift), so layers are distinct and reproducible.
fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// Writes an image (config + layers + manifest) into a layout and names it; returns the manifest descriptor.
fn write_image(
    layout: &Layout,
    name: Option<&str>,
    layers: &[Vec<u8>],
    platform: &str,
) -> Descriptor {
    let p = Platform::parse(platform).unwrap();
    let mut layer_descs = Vec::new();
    let mut diff_ids = Vec::new();
    for l in layers {
        let c = layout.write_blob(l).unwrap();
        layer_descs.push(Descriptor::new(
            spec::MEDIA_TYPE_LAYER_TAR,
            c.digest,
            c.size,
        ));
        diff_ids.push(c.digest.to_string());
    }
    let config = serde_json::json!({
        "architecture": p.architecture, "os": p.os,
        "rootfs": {"type": "layers", "diff_ids": diff_ids}, "config": {}
    });
    let config = layout
        .write_blob(&serde_json::to_vec(&config).unwrap())
        .unwrap();
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": spec::MEDIA_TYPE_MANIFEST,
        "config": Descriptor::new(spec::MEDIA_TYPE_CONFIG, config.digest, config.size),
        "layers": layer_descs,
    });
    let m = layout
        .write_blob(&serde_json::to_vec(&manifest).unwrap())
        .unwrap();
    let mut d = Descriptor::new(spec::MEDIA_TYPE_MANIFEST, m.digest, m.size);
    if let Some(n) = name {
        layout.set_ref(n, &d).unwrap();
    }
    d.platform = Some(p);
    d
}

/// A small image in a fresh layout `DIR/layout`, named `app`; returns the layout and manifest digest.
fn small_image(dir: &Path, seed: u64) -> (Layout, Digest) {
    let layout = Layout::create(&dir.join("layout")).unwrap();
    let d = write_image(
        &layout,
        Some("app"),
        &[noise(seed, 300_000), noise(seed + 1, 40_000)],
        "linux/amd64",
    );
    (layout, d.digest)
}

/// A two-platform index named `multi` in the layout; returns the index digest.
fn multi_arch(layout: &Layout) -> Digest {
    let amd = write_image(layout, None, &[noise(11, 50_000)], "linux/amd64");
    let arm = write_image(layout, None, &[noise(12, 60_000)], "linux/arm64/v8");
    let mut index = Index::empty();
    index.manifests = vec![amd, arm];
    let c = layout.write_blob(&spec::to_json_bytes(&index)).unwrap();
    layout
        .set_ref(
            "multi",
            &Descriptor::new(spec::MEDIA_TYPE_INDEX, c.digest, c.size),
        )
        .unwrap();
    c.digest
}

fn oci(args: &[&str]) -> Command {
    testkit::oci::cli(args)
}

/// Runs oci expecting success; returns its stdout trimmed.
fn ok(args: &[&str]) -> String {
    testkit::ok(&mut oci(args)).trim().to_string()
}

/// Runs oci expecting failure; returns its one-line stderr.
fn fails(args: &[&str]) -> String {
    let err = testkit::fails(&mut oci(args));
    assert_eq!(err.lines().count(), 1, "one line expected: {err}");
    err.trim().to_string()
}

fn json(args: &[&str]) -> serde_json::Value {
    serde_json::from_str(&ok(args)).unwrap()
}

fn skopeo(args: &[&str]) -> String {
    // --preserve-digests: skopeo would otherwise compress uncompressed layers on the way.
    let (verb, rest) = args.split_first().expect("a skopeo verb");
    let mut c = Command::new("skopeo");
    c.args(["--insecure-policy", verb]);
    if *verb == "copy" {
        c.arg("--preserve-digests");
    }
    testkit::ok(c.args(rest))
}

/// The exact manifest bytes skopeo reads from an image.
fn skopeo_raw(image: &str, extra: &[&str]) -> Vec<u8> {
    let out = testkit::output(
        Command::new("skopeo")
            .args(["inspect", "--raw"])
            .args(extra)
            .arg(image),
    );
    assert!(
        out.status.success(),
        "skopeo inspect {image}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// The exact manifest bytes skopeo reads from an image on a plain-HTTP registry.
fn skopeo_plain(image: &str) -> Vec<u8> {
    skopeo_raw(image, &["--tls-verify=false"])
}

/// skopeo copies an image from a plain-HTTP registry into the layout `dir`, named `name`.
fn skopeo_pull(image: &str, extra: &[&str], dir: &Path, name: &str) {
    let dest = format!("oci:{}:{name}", dir.display());
    let mut args = vec!["copy", "--src-tls-verify=false"];
    args.extend_from_slice(extra);
    args.extend([image, dest.as_str()]);
    skopeo(&args);
}

/// The `oci:` reference of the image `small_image` names `app`.
fn app_src(layout: &Layout) -> String {
    format!("oci:{}:app", layout.dir().display())
}

/// Pushes a layout's `app` image to a plain-HTTP registry; returns the digest oci printed.
fn push_app(layout: &Layout, dst: &str) -> String {
    ok(&["push", &app_src(layout), dst, "--plain-http"])
}

/// A copy's JSON report says all three blobs were mounted and no byte was uploaded.
fn assert_all_mounted(report: &serde_json::Value) {
    assert_eq!(
        (
            report["blobsMounted"].as_u64(),
            report["bytesUploaded"].as_u64()
        ),
        (Some(3), Some(0))
    );
}

/// oci's line for an image the registry does not hold.
fn not_found(image: &str) -> String {
    format!("oci: {image} not found (404): check the repository, tag and digest")
}

#[test]
fn push_is_what_skopeo_inspects_and_copies_out() {
    let tmp = testkit::tempdir();
    let (layout, digest) = small_image(tmp.path(), 1);
    let reg = Registry::plain();
    let out = push_app(&layout, &reg.image("team/app:v1"));
    assert_eq!(out, digest.to_string());
    let raw = skopeo_plain(&reg.image("team/app:v1"));
    assert_eq!(
        Digest::of(&raw),
        digest,
        "skopeo sees the same manifest bytes"
    );
    assert_eq!(
        raw,
        layout.read_blob(&digest, None).unwrap(),
        "the manifest went up as stored"
    );
    let out = tmp.path().join("skopeo-out");
    skopeo_pull(&reg.image("team/app:v1"), &[], &out, "back");
    let back = Layout::open(&out).unwrap();
    let d = back
        .resolve(&oci::RefOrDigest::Name("back".into()))
        .unwrap();
    assert_eq!(d.digest, digest);
    for blob in ["layers"] {
        let m: serde_json::Value =
            serde_json::from_slice(&back.read_blob(&digest, None).unwrap()).unwrap();
        for l in m[blob].as_array().unwrap() {
            let ld: Digest = l["digest"].as_str().unwrap().parse().unwrap();
            assert_eq!(
                back.read_blob(&ld, None).ok().map(|b| b.len()),
                layout.read_blob(&ld, None).ok().map(|b| b.len())
            );
            back.verify_blob(&ld, None).unwrap();
        }
    }
}

#[test]
fn repeat_push_uploads_zero_blob_bytes() {
    let tmp = testkit::tempdir();
    let (layout, digest) = small_image(tmp.path(), 2);
    let reg = Registry::plain();
    let src = app_src(&layout);
    let first = json(&["push", &src, &reg.image("app:v1"), "--plain-http", "--json"]);
    assert_eq!(first["blobsUploaded"], 3);
    assert_eq!(reg.blob_uploads(), 3);
    let again = json(&["push", &src, &reg.image("app:v1"), "--plain-http", "--json"]);
    assert_eq!(again["alreadyPresent"], true);
    assert_eq!(again["bytesUploaded"], 0);
    assert_eq!(
        reg.blob_uploads(),
        3,
        "the repeat push sent no blob:\n{:#?}",
        reg.requests()
    );
    // A new tag for the same image: one HEAD per blob, no upload, one manifest PUT.
    let heads = reg.count("HEAD /v2/app/blobs/");
    let tagged = json(&["push", &src, &reg.image("app:v2"), "--plain-http", "--json"]);
    assert_eq!(
        (
            tagged["blobsPresent"].as_u64(),
            tagged["manifestsPushed"].as_u64()
        ),
        (Some(3), Some(1))
    );
    assert_eq!(reg.count("HEAD /v2/app/blobs/") - heads, 3);
    assert_eq!(reg.blob_uploads(), 3);
    assert_eq!(tagged["digest"], digest.to_string());
}

#[test]
fn copy_within_one_registry_mounts_instead_of_uploading() {
    let tmp = testkit::tempdir();
    let (layout, digest) = small_image(tmp.path(), 3);
    let reg = Registry::plain();
    push_app(&layout, &reg.image("src/app:1"));
    let uploads = reg.blob_uploads();
    let r = json(&[
        "copy",
        &reg.image("src/app:1"),
        &reg.image("dst/app:1"),
        "--plain-http",
        "--json",
    ]);
    assert_all_mounted(&r);
    assert_eq!(reg.blob_uploads(), uploads, "no blob bytes moved");
    assert_eq!(
        reg.count("POST /v2/dst/app/blobs/uploads/?mount=sha256:"),
        3
    );
    assert!(
        reg.requests()
            .iter()
            .filter(|r| r.contains("mount="))
            .all(|r| r.ends_with(" 201"))
    );
    assert_eq!(Digest::of(&skopeo_plain(&reg.image("dst/app:1"))), digest);
}

#[test]
fn copy_between_registries_is_byte_exact_and_a_repeat_moves_nothing() {
    let tmp = testkit::tempdir();
    let (layout, digest) = small_image(tmp.path(), 4);
    let (a, b) = (Registry::plain(), Registry::plain());
    // skopeo pushes, oci copies: the bytes skopeo stored arrive unchanged.
    skopeo(&[
        "copy",
        "--dest-tls-verify=false",
        &app_src(&layout),
        &a.image("app:1"),
    ]);
    let from_skopeo = skopeo_plain(&a.image("app:1"));
    let out = ok(&[
        "copy",
        &a.image("app:1"),
        &b.image("mirror/app:1"),
        "--plain-http",
    ]);
    assert_eq!(out, Digest::of(&from_skopeo).to_string());
    assert_eq!(skopeo_plain(&b.image("mirror/app:1")), from_skopeo);
    assert_eq!(Digest::of(&from_skopeo), digest);
    let uploads = b.blob_uploads();
    assert_eq!(uploads, 3);
    let again = json(&[
        "copy",
        &a.image("app:1"),
        &b.image("mirror/app:1"),
        "--plain-http",
        "--json",
    ]);
    assert_eq!(
        (
            again["alreadyPresent"].as_bool(),
            again["bytesUploaded"].as_u64()
        ),
        (Some(true), Some(0))
    );
    assert_eq!(b.blob_uploads(), uploads);
    // Out to a layout and back: skopeo reads the layout with the same digest.
    let out = tmp.path().join("pulled");
    ok(&[
        "copy",
        &b.image("mirror/app:1"),
        &format!("oci:{}:pulled", out.display()),
        "--plain-http",
    ]);
    assert_eq!(
        Digest::of(&skopeo_raw(&format!("oci:{}:pulled", out.display()), &[])),
        digest
    );
}

#[test]
fn index_copies_whole_and_platform_filter_makes_a_valid_smaller_index() {
    let tmp = testkit::tempdir();
    let layout = Layout::create(&tmp.path().join("layout")).unwrap();
    let index_digest = multi_arch(&layout);
    let reg = Registry::plain();
    let src = format!("oci:{}:multi", layout.dir().display());
    assert_eq!(
        ok(&["push", &src, &reg.image("multi:all"), "--plain-http"]),
        index_digest.to_string()
    );
    assert_eq!(
        skopeo_plain(&reg.image("multi:all")),
        layout.read_blob(&index_digest, None).unwrap()
    );
    let arm = ok(&[
        "copy",
        &reg.image("multi:all"),
        &reg.image("arm/only:1"),
        "--plain-http",
        "--platform",
        "linux/arm64",
    ]);
    let raw = skopeo_plain(&reg.image("arm/only:1"));
    assert_eq!(Digest::of(&raw).to_string(), arm);
    let filtered: Index = serde_json::from_slice(&raw).unwrap();
    assert_eq!(filtered.manifests.len(), 1);
    assert_eq!(
        filtered.manifests[0].platform.as_ref().unwrap().to_string(),
        "linux/arm64/v8"
    );
    // skopeo resolves the filtered index for arm64 and copies that image out.
    let out = tmp.path().join("arm");
    skopeo_pull(
        &reg.image("arm/only:1"),
        &["--override-arch", "arm64"],
        &out,
        "a",
    );
    let err = fails(&[
        "copy",
        &reg.image("multi:all"),
        &reg.image("x:1"),
        "--plain-http",
        "--platform",
        "linux/s390x",
    ]);
    assert_eq!(
        err,
        format!(
            "oci: no manifest of {} is for linux/s390x: it has linux/amd64, linux/arm64/v8; pass one of those to --platform",
            reg.image("multi:all")
        )
    );
}

#[test]
fn chunked_upload_when_asked() {
    let tmp = testkit::tempdir();
    let (layout, digest) = small_image(tmp.path(), 5);
    let reg = Registry::plain();
    let src = app_src(&layout);
    ok(&[
        "push",
        &src,
        &reg.image("chunks:1"),
        "--plain-http",
        "--chunk-size",
        "65536",
    ]);
    // 300 000 bytes in 64 KiB chunks is 5 PATCHes; 40 000 and the config are one each.
    assert_eq!(
        reg.count("PATCH /v2/chunks/blobs/uploads/"),
        7,
        "{:#?}",
        reg.requests()
    );
    assert_eq!(Digest::of(&skopeo_plain(&reg.image("chunks:1"))), digest);
    let out = tmp.path().join("out");
    skopeo_pull(&reg.image("chunks:1"), &[], &out, "x");
}

#[test]
fn mutual_tls_with_flags_and_certs_d_and_the_messages_without() {
    let pki = Pki::new();
    let tmp = testkit::tempdir();
    let (layout, digest) = small_image(tmp.path(), 6);
    let reg = Registry::tls(&pki);
    let src = app_src(&layout);
    let (cert, key, ca) = (
        pki.client_cert.to_str().unwrap(),
        pki.client_key.to_str().unwrap(),
        pki.ca_cert.to_str().unwrap(),
    );
    let dst = reg.image("secure/app:1");
    let out = ok(&[
        "push",
        &src,
        &dst,
        "--tls-cert",
        cert,
        "--tls-key",
        key,
        "--tls-ca",
        ca,
    ]);
    assert_eq!(out, digest.to_string());
    // certs.d: HOST:PORT/ca.crt, client.cert, client.key, as Docker and skopeo lay them out.
    let certs = tmp.path().join("certs.d");
    let host_dir = certs.join(reg.host());
    std::fs::create_dir_all(&host_dir).unwrap();
    std::fs::copy(&pki.ca_cert, host_dir.join("ca.crt")).unwrap();
    std::fs::copy(&pki.client_cert, host_dir.join("client.cert")).unwrap();
    std::fs::copy(&pki.client_key, host_dir.join("client.key")).unwrap();
    let certs_s = certs.to_str().unwrap();
    let shown = json(&["inspect", &dst, "--certs-dir", certs_s, "--json"]);
    assert_eq!(shown["digest"], digest.to_string());
    assert_eq!(
        Digest::of(&skopeo_raw(
            &dst,
            &["--cert-dir", host_dir.to_str().unwrap()]
        )),
        digest
    );
    let empty = tmp.path().join("no-certs");
    let empty_s = empty.to_str().unwrap();
    let err = fails(&["inspect", &dst, "--tls-ca", ca, "--certs-dir", empty_s]);
    assert_eq!(
        err,
        format!(
            "oci: registry {} requires a client certificate: pass --tls-cert FILE and --tls-key FILE or put client.cert and client.key in {}",
            reg.host(),
            empty.join(reg.host()).display()
        )
    );
    let other = pki.other_ca_cert.to_str().unwrap();
    let err = fails(&[
        "inspect",
        &dst,
        "--tls-ca",
        other,
        "--tls-cert",
        cert,
        "--tls-key",
        key,
        "--certs-dir",
        empty_s,
    ]);
    assert_eq!(
        err,
        format!(
            "oci: registry {} presented a certificate that is not trusted (unknownissuer): pass its CA with --tls-ca FILE or put it in {}/ca.crt",
            reg.host(),
            empty.join(reg.host()).display()
        )
    );
    let (stranger, stranger_key) = (
        pki.stranger_cert.to_str().unwrap(),
        pki.stranger_key.to_str().unwrap(),
    );
    let err = fails(&[
        "inspect",
        &dst,
        "--tls-ca",
        ca,
        "--tls-cert",
        stranger,
        "--tls-key",
        stranger_key,
    ]);
    assert_eq!(
        err,
        format!(
            "oci: registry {} rejected the client certificate {stranger}: pass --tls-cert with one signed by a CA the registry trusts",
            reg.host()
        )
    );
    let err = fails(&["inspect", &dst, "--plain-http"]);
    assert_eq!(
        err,
        format!(
            "oci: registry {} answered plain HTTP with something else: drop --plain-http if it serves TLS",
            reg.host()
        )
    );
}

#[test]
fn built_image_pushes_and_skopeo_copies_it_out() {
    let tmp = testkit::tempdir();
    let root = tmp.path().join("root");
    std::fs::create_dir_all(root.join("etc")).unwrap();
    std::fs::write(root.join("etc/motd"), "hello from oci build\n").unwrap();
    let layout = tmp.path().join("built");
    let digest = ok(&[
        "build",
        "--layout",
        layout.to_str().unwrap(),
        "--ref",
        "web",
        "--root",
        root.to_str().unwrap(),
    ]);
    let reg = Registry::plain();
    let pushed = ok(&[
        "push",
        &format!("oci:{}:web", layout.display()),
        &reg.image("web:1"),
        "--plain-http",
    ]);
    assert_eq!(pushed, digest);
    let shown = json(&["inspect", &reg.image("web:1"), "--plain-http", "--json"]);
    assert_eq!(shown["digest"], digest);
    // Remote and local inspect say the same thing, in JSON and in text.
    let local = format!("oci:{}:web", layout.display());
    assert_eq!(shown, json(&["inspect", &local, "--json"]));
    assert_eq!(
        ok(&["inspect", &reg.image("web:1"), "--plain-http"]),
        ok(&["inspect", &local])
    );
    let raw = testkit::ok(&mut oci(&[
        "inspect",
        &reg.image(&format!("web@{digest}")),
        "--plain-http",
        "--raw",
    ]));
    assert_eq!(Digest::of(raw.as_bytes()).to_string(), digest);
    let out = tmp.path().join("out");
    skopeo_pull(&reg.image("web:1"), &[], &out, "web");
    assert_eq!(
        Digest::of(&skopeo_raw(&format!("oci:{}:web", out.display()), &[])).to_string(),
        digest
    );
}

#[test]
fn basic_auth_from_flag_env_and_auth_file_and_the_messages_without() {
    let tmp = testkit::tempdir();
    let (layout, digest) = small_image(tmp.path(), 7);
    let reg = Registry::start(Options {
        user: Some(("ci", "s3cret")),
        ..Options::default()
    });
    let src = app_src(&layout);
    let dst = reg.image("private/app:1");
    let err = fails(&["push", &src, &dst, "--plain-http"]);
    assert_eq!(
        err,
        format!(
            "oci: registry {} needs credentials for private/app (401 unauthorized): pass --creds USER:PASS, set $OCI_CREDS or log in with docker login",
            reg.host()
        )
    );
    let err = fails(&["push", &src, &dst, "--plain-http", "--creds", "ci:wrong"]);
    assert_eq!(
        err,
        format!(
            "oci: registry {} refused the credentials for private/app (401 unauthorized): check the user and password given by --creds or the auth file",
            reg.host()
        )
    );
    assert!(!err.contains("wrong"), "the password is never printed");
    assert_eq!(
        reg.count("PUT /v2/private/app/manifests/"),
        0,
        "nothing was tagged"
    );
    assert_eq!(
        ok(&["push", &src, &dst, "--plain-http", "--creds", "ci:s3cret"]),
        digest.to_string()
    );
    // $OCI_CREDS, then an auth.json as podman and skopeo write it.
    let shown = testkit::ok(
        oci(&["inspect", &dst, "--plain-http", "--json"]).env("OCI_CREDS", "ci:s3cret"),
    );
    assert!(shown.contains(&digest.to_string()));
    let auth = tmp.path().join("auth.json");
    let token = "Y2k6czNjcmV0"; // base64("ci:s3cret")
    std::fs::write(
        &auth,
        format!(r#"{{"auths":{{"{}":{{"auth":"{token}"}}}}}}"#, reg.host()),
    )
    .unwrap();
    let shown = testkit::ok(
        oci(&["inspect", &dst, "--plain-http", "--json"]).env("REGISTRY_AUTH_FILE", &auth),
    );
    assert!(shown.contains(&digest.to_string()));
    // skopeo, given the same file, agrees.
    let raw = testkit::ok(
        Command::new("skopeo")
            .args(["inspect", "--raw", "--tls-verify=false", "--authfile"])
            .arg(&auth)
            .arg(&dst),
    );
    assert_eq!(Digest::of(raw.as_bytes()), digest);
    // A credential helper named by Docker's config.json, found on PATH.
    let bin = tmp.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let helper = bin.join("docker-credential-fleettest");
    std::fs::write(
        &helper,
        format!(
            "#!/bin/sh\nread host\nif [ \"$1\" = get ] && [ \"$host\" = {} ]; then echo '{{\"Username\":\"ci\",\"Secret\":\"s3cret\"}}'; exit 0; fi\necho 'credentials not found in native keychain'; exit 1\n",
            reg.host()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&helper, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let docker = tmp.path().join("docker");
    std::fs::create_dir_all(&docker).unwrap();
    std::fs::write(
        docker.join("config.json"),
        format!(r#"{{"credHelpers":{{"{}":"fleettest"}}}}"#, reg.host()),
    )
    .unwrap();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let shown = testkit::ok(
        oci(&["inspect", &dst, "--plain-http", "--json"])
            .env("DOCKER_CONFIG", &docker)
            .env("PATH", path),
    );
    assert!(shown.contains(&digest.to_string()));
    let err = fails(&["inspect", &dst, "--plain-http", "--creds", "nocolon"]);
    assert_eq!(
        err,
        "oci: --creds must be USER:PASS (the password is never printed)"
    );
}

#[test]
fn network_and_reference_faults_each_get_one_line() {
    let tmp = testkit::tempdir();
    let (layout, _) = small_image(tmp.path(), 8);
    let src = app_src(&layout);
    let port = testkit::registry::free_port();
    let err = fails(&[
        "push",
        &src,
        &format!("docker://127.0.0.1:{port}/app:1"),
        "--plain-http",
    ]);
    assert_eq!(
        err,
        format!(
            "oci: cannot connect to registry 127.0.0.1:{port}: connection refused; check the host and port and that the registry is running"
        )
    );
    let err = fails(&["push", &src, "docker://no-such-registry.invalid/app:1"]);
    assert_eq!(
        err,
        "oci: cannot resolve registry host no-such-registry.invalid: check the host name in the reference"
    );
    let err = fails(&["push", &src, "docker://127.0.0.1:5000/App:1"]);
    assert_eq!(
        err,
        "oci: bad reference \"docker://127.0.0.1:5000/App:1\": the repository must be lowercase letters, digits and . _ - separated by /; use oci:DIR:REF, oci:DIR@sha256:HEX or docker://HOST[:PORT]/REPO[:TAG|@sha256:HEX]"
    );
    let err = fails(&[
        "copy",
        "registry.example/app",
        "docker://127.0.0.1:5000/app",
    ]);
    assert_eq!(
        err,
        "oci: bad reference \"registry.example/app\": unknown transport; use oci:DIR:REF, oci:DIR@sha256:HEX or docker://HOST[:PORT]/REPO[:TAG|@sha256:HEX]"
    );
    let reg = Registry::plain();
    let err = fails(&["inspect", &reg.image("missing:1"), "--plain-http"]);
    assert_eq!(err, not_found(&reg.image("missing:1")));
    let err = fails(&[
        "copy",
        &reg.image("missing:1"),
        &reg.image("other:1"),
        "--plain-http",
    ]);
    assert_eq!(err, not_found(&reg.image("missing:1")));
}

#[test]
fn corrupt_blob_is_refused_and_no_tag_points_at_a_half_pushed_image() {
    let tmp = testkit::tempdir();
    let (layout, _) = small_image(tmp.path(), 9);
    let m: serde_json::Value =
        serde_json::from_slice(&layout.read_blob(&small_manifest(&layout), None).unwrap()).unwrap();
    let victim: Digest = m["layers"][0]["digest"].as_str().unwrap().parse().unwrap();
    let path = layout.blob_path(&victim);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[1000] ^= 0xff;
    std::fs::write(&path, &bytes).unwrap();
    let actual = Digest::of(&bytes);
    let reg = Registry::plain();
    let err = fails(&[
        "push",
        &app_src(&layout),
        &reg.image("app:1"),
        "--plain-http",
    ]);
    assert_eq!(
        err,
        format!(
            "oci: blob {victim} does not match its digest: its 300000 bytes hash to {actual}; the source is corrupt: rebuild or re-pull it"
        )
    );
    assert_eq!(
        reg.count("PUT /v2/app/manifests/"),
        0,
        "the manifest was never put"
    );
    let err = fails(&["inspect", &reg.image("app:1"), "--plain-http"]);
    assert!(err.contains("not found (404)"), "{err}");
    let out = testkit::output(
        Command::new("curl")
            .args(["-sf", "-I"])
            .arg(format!("http://{}/v2/app/blobs/{victim}", reg.host())),
    );
    assert!(
        !out.status.success(),
        "the registry holds no blob under the digest"
    );
}

fn small_manifest(layout: &Layout) -> Digest {
    layout
        .resolve(&oci::RefOrDigest::Name("app".into()))
        .unwrap()
        .digest
}

#[test]
fn registry_faults_403_415_and_retries_429_503() {
    let tmp = testkit::tempdir();
    let (layout, digest) = small_image(tmp.path(), 10);
    let src = app_src(&layout);
    let reg = Registry::plain();
    let fault = Fault::new;
    let proxy = FaultProxy::start(reg.addr, vec![fault("*", "/v2/", 403, usize::MAX)]);
    let err = fails(&["push", &src, &proxy.image("app:1"), "--plain-http"]);
    assert_eq!(
        err,
        format!(
            "oci: registry {} denied push access to app (403 forbidden): use credentials allowed to push there",
            proxy.host()
        )
    );
    let proxy = FaultProxy::start(reg.addr, vec![fault("PUT", "/manifests/", 415, usize::MAX)]);
    let err = fails(&["push", &src, &proxy.image("app:1"), "--plain-http"]);
    assert_eq!(
        err,
        format!(
            "oci: registry {} does not accept media type application/vnd.oci.image.manifest.v1+json (415): push to a registry that supports it",
            proxy.host()
        )
    );
    // Transient answers are retried with backoff: 503 on the first upload PUTs, 429 on a HEAD.
    let mut too_many = fault("HEAD", "/blobs/", 429, 1);
    too_many.headers = vec![("Retry-After", "1")];
    let proxy = FaultProxy::start(
        reg.addr,
        vec![
            too_many,
            fault("PUT", "/blobs/uploads/", 503, 2),
            fault("PUT", "/manifests/", 502, 1),
        ],
    );
    let out = ok(&[
        "push",
        &src,
        &proxy.image("retry:1"),
        "--plain-http",
        "--jobs",
        "1",
    ]);
    assert_eq!(out, digest.to_string());
    assert_eq!((proxy.injected(), proxy.armed()), (4, 0));
    // A registry that never recovers: a bounded number of tries, then one line.
    let proxy = FaultProxy::start(
        reg.addr,
        vec![fault("HEAD", "/manifests/", 503, usize::MAX)],
    );
    let err = fails(&["push", &src, &proxy.image("down:1"), "--plain-http"]);
    assert_eq!(
        err,
        format!(
            "oci: registry {} kept answering 503 to HEAD /v2/down/manifests/1 after 5 tries: try again later",
            proxy.host()
        )
    );
}

#[test]
fn a_413_falls_back_to_chunks_of_at_least_the_asked_length() {
    let tmp = testkit::tempdir();
    let (layout, digest) = small_image(tmp.path(), 13);
    let src = app_src(&layout);
    let reg = Registry::plain();
    let proxy = FaultProxy::start(reg.addr, vec![Fault::new("PUT", "/blobs/uploads/", 413, 1)]);
    let out = ok(&[
        "push",
        &src,
        &proxy.image("big:1"),
        "--plain-http",
        "--jobs",
        "1",
    ]);
    assert_eq!(out, digest.to_string());
    // The largest blob (300 000 bytes) went first, met the 413 and went up as one PATCH chunk.
    assert_eq!(
        reg.count("PATCH /v2/big/blobs/uploads/"),
        1,
        "{:#?}",
        reg.requests()
    );
    assert_eq!(Digest::of(&skopeo_plain(&reg.image("big:1"))), digest);
}

#[test]
fn bearer_tokens_with_scopes_including_pull_on_a_mount_source() {
    use testkit::registry::TokenServer;
    let tmp = testkit::tempdir();
    let (layout, digest) = small_image(tmp.path(), 14);
    let tokens = TokenServer::start(vec![
        ("ci", "pw", &["pull", "push"]),
        ("reader", "pw", &["pull"]),
    ]);
    let reg = Registry::start(Options {
        token: Some(&tokens),
        ..Options::default()
    });
    let src = app_src(&layout);
    let err = fails(&["push", &src, &reg.image("src/app:1"), "--plain-http"]);
    assert_eq!(
        err,
        format!(
            "oci: registry {} needs credentials for src/app (401 unauthorized): pass --creds USER:PASS, set $OCI_CREDS or log in with docker login",
            reg.host()
        )
    );
    assert_eq!(
        ok(&[
            "push",
            &src,
            &reg.image("src/app:1"),
            "--plain-http",
            "--creds",
            "ci:pw"
        ]),
        digest.to_string()
    );
    assert!(
        tokens
            .requests()
            .iter()
            .any(|q| q.contains("scope=repository:src/app:pull,push")
                && q.contains("service=fleet-registry"))
    );
    let err = fails(&[
        "push",
        &src,
        &reg.image("other/app:1"),
        "--plain-http",
        "--creds",
        "reader:pw",
    ]);
    assert_eq!(
        err,
        format!(
            "oci: registry {} denied push access to other/app (403 forbidden): use credentials allowed to push there",
            reg.host()
        )
    );
    let shown = json(&[
        "inspect",
        &reg.image("src/app:1"),
        "--plain-http",
        "--creds",
        "reader:pw",
        "--json",
    ]);
    assert_eq!(shown["digest"], digest.to_string());
    let r = json(&[
        "copy",
        &reg.image("src/app:1"),
        &reg.image("dst/app:1"),
        "--plain-http",
        "--creds",
        "ci:pw",
        "--json",
    ]);
    assert_all_mounted(&r);
    assert!(
        tokens
            .requests()
            .iter()
            .any(|q| q.contains("scope=repository:dst/app:pull,push")
                && q.contains("scope=repository:src/app:pull")),
        "the mount asked for pull on its source: {:#?}",
        tokens.requests()
    );
}

#[test]
fn a_manifest_of_an_unknown_media_type_is_refused_before_anything_moves() {
    let tmp = testkit::tempdir();
    let layout = Layout::create(&tmp.path().join("layout")).unwrap();
    let odd = "application/vnd.example.thing.v1+json";
    let doc = serde_json::json!({"schemaVersion": 2, "mediaType": odd});
    let c = layout
        .write_blob(&serde_json::to_vec(&doc).unwrap())
        .unwrap();
    layout
        .set_ref("odd", &Descriptor::new(odd, c.digest, c.size))
        .unwrap();
    let reg = Registry::plain();
    let src = format!("oci:{}:odd", layout.dir().display());
    let err = fails(&["push", &src, &reg.image("odd:1"), "--plain-http"]);
    assert_eq!(
        err,
        format!(
            "oci: {src} has media type {odd}, which oci does not handle: only OCI and Docker schema 2 manifests and indexes can be copied"
        )
    );
    assert_eq!(reg.requests().len(), 0, "nothing was sent");
}

#[test]
fn a_mount_answered_202_uploads_into_the_session_it_opened() {
    let tmp = testkit::tempdir();
    let (layout, digest) = small_image(tmp.path(), 15);
    let reg = Registry::plain();
    push_app(&layout, &reg.image("src/app:1"));
    // The proxy drops ?mount= so the registry opens a plain session (202) instead of mounting (201).
    let mut ignore_mounts = Fault::new("POST", "?mount=", 0, usize::MAX);
    ignore_mounts.drop_query = true;
    let proxy = FaultProxy::start(reg.addr, vec![ignore_mounts]);
    let (from, to) = (proxy.image("src/app:1"), proxy.image("dst/app:1"));
    let r = json(&["copy", &from, &to, "--plain-http", "--json"]);
    assert_eq!(
        (r["blobsMounted"].as_u64(), r["blobsUploaded"].as_u64()),
        (Some(0), Some(3))
    );
    assert_eq!(proxy.injected(), 3, "every blob asked for a mount");
    assert_eq!(
        reg.count("POST /v2/dst/app/blobs/uploads/"),
        3,
        "one session per blob, the one the mount answer opened"
    );
    assert_eq!(reg.count("PUT /v2/dst/app/blobs/uploads/"), 3);
    assert_eq!(Digest::of(&skopeo_plain(&reg.image("dst/app:1"))), digest);
}

#[test]
fn a_failed_copy_into_a_new_layout_leaves_no_layout() {
    let tmp = testkit::tempdir();
    let layout = Layout::create(&tmp.path().join("src")).unwrap();
    multi_arch(&layout);
    let multi = format!("oci:{}:multi", layout.dir().display());
    let new = tmp.path().join("new/layout");
    let dst = format!("oci:{}:x", new.display());
    let reg = Registry::plain();
    let missing = reg.image("missing:1");
    let refused = format!(
        "docker://127.0.0.1:{}/app:1",
        testkit::registry::free_port()
    );
    let port = refused
        .split(':')
        .nth(2)
        .unwrap()
        .split('/')
        .next()
        .unwrap();
    let cases = [
        (
            vec!["copy", &multi, &dst, "--platform", "linux/s390x"],
            format!(
                "oci: no manifest of {multi} is for linux/s390x: it has linux/amd64, linux/arm64/v8; pass one of those to --platform"
            ),
        ),
        (
            vec!["copy", &missing, &dst, "--plain-http"],
            not_found(&missing),
        ),
        (
            vec!["copy", &refused, &dst, "--plain-http"],
            format!(
                "oci: cannot connect to registry 127.0.0.1:{port}: connection refused; check the host and port and that the registry is running"
            ),
        ),
    ];
    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let into_empty = format!("oci:{}:x", empty.display());
    for (args, message) in &cases {
        assert_eq!(&fails(args), message);
        assert!(!new.exists(), "no layout is left after: {message}");
        // An empty folder given as the destination stays an empty folder.
        let mut args = args.clone();
        args[2] = &into_empty;
        assert_eq!(&fails(&args), message);
        assert_eq!(std::fs::read_dir(&empty).unwrap().count(), 0, "{message}");
    }
    // The same copy that works makes the layout.
    ok(&["copy", &multi, &dst, "--platform", "linux/amd64"]);
    assert!(new.join("oci-layout").is_file());
}

#[test]
fn a_v1_client_certificate_is_presented_and_only_a_key_that_differs_is_refused() {
    let pki = Pki::new();
    let text = testkit::ok(
        Command::new("openssl")
            .args(["x509", "-noout", "-text", "-in"])
            .arg(&pki.client_v1_cert),
    );
    assert!(text.contains("Version: 1 (0x0)"), "{text}");
    let tmp = testkit::tempdir();
    let (layout, digest) = small_image(tmp.path(), 21);
    let reg = Registry::tls(&pki);
    let (cert, key, ca) = (
        pki.client_v1_cert.to_str().unwrap(),
        pki.client_v1_key.to_str().unwrap(),
        pki.ca_cert.to_str().unwrap(),
    );
    // curl, an independent client, is let in with it: the registry accepts a v1 certificate.
    testkit::ok(Command::new("curl").args([
        "-sf",
        "--cacert",
        ca,
        "--cert",
        cert,
        "--key",
        key,
        &format!("https://{}/v2/", reg.host()),
    ]));
    let tls = ["--tls-cert", cert, "--tls-key", key, "--tls-ca", ca];
    let dst = reg.image("v1/app:1");
    let src = app_src(&layout);
    let mut args = vec!["push", &src, &dst];
    args.extend(tls);
    assert_eq!(ok(&args), digest.to_string());
    let copied = reg.image("v1/copied:1");
    let mut args = vec!["copy", &dst, &copied];
    args.extend(tls);
    assert_eq!(ok(&args), digest.to_string());
    let out = format!("oci:{}:pulled", tmp.path().join("pulled").display());
    let mut args = vec!["copy", &copied, &out];
    args.extend(tls);
    assert_eq!(ok(&args), digest.to_string());
    assert_eq!(
        Digest::of(&skopeo_raw(
            &copied,
            &["--cert-dir", tls_dir(tmp.path(), &pki).to_str().unwrap()]
        )),
        digest
    );
    // A key that truly belongs to another certificate gets the message about the key.
    let other_key = pki.client_key.to_str().unwrap();
    let err = fails(&[
        "inspect",
        &dst,
        "--tls-cert",
        cert,
        "--tls-key",
        other_key,
        "--tls-ca",
        ca,
    ]);
    assert_eq!(
        err,
        format!(
            "oci: the client certificate {cert} does not go with its key {other_key} (their public keys differ): pass the matching --tls-key"
        )
    );
}

/// A folder skopeo reads with --cert-dir: the CA and the v1 client certificate and key.
fn tls_dir(dir: &Path, pki: &Pki) -> std::path::PathBuf {
    let d = dir.join("skopeo-certs");
    std::fs::create_dir_all(&d).unwrap();
    std::fs::copy(&pki.ca_cert, d.join("ca.crt")).unwrap();
    std::fs::copy(&pki.client_v1_cert, d.join("client.cert")).unwrap();
    std::fs::copy(&pki.client_v1_key, d.join("client.key")).unwrap();
    d
}

#[test]
fn plain_http_against_a_tls_registry_says_to_drop_it() {
    let pki = Pki::new();
    let tmp = testkit::tempdir();
    let (layout, _) = small_image(tmp.path(), 22);
    let reg = Registry::tls(&pki);
    let message = format!(
        "oci: registry {} answered plain HTTP with something else: drop --plain-http if it serves TLS",
        reg.host()
    );
    // push and copy first ask with HEAD, whose answer has no body to read the reason from.
    let dst = reg.image("app:1");
    assert_eq!(
        fails(&["push", &app_src(&layout), &dst, "--plain-http"]),
        message
    );
    let out = format!("oci:{}:x", tmp.path().join("out").display());
    assert_eq!(
        fails(&["copy", &app_src(&layout), &dst, "--plain-http"]),
        message
    );
    assert_eq!(fails(&["copy", &dst, &out, "--plain-http"]), message);
    assert_eq!(fails(&["inspect", &dst, "--plain-http"]), message);
}

#[test]
fn a_tag_holding_a_colon_is_reported_as_a_bad_tag() {
    let tmp = testkit::tempdir();
    let (layout, _) = small_image(tmp.path(), 23);
    let err = fails(&[
        "push",
        &app_src(&layout),
        "docker://127.0.0.1:5000/team/app:bad:tag",
    ]);
    assert_eq!(
        err,
        "oci: bad reference \"docker://127.0.0.1:5000/team/app:bad:tag\": the tag must be 1 to 128 letters, digits, _ . or -, not starting with . or -; use oci:DIR:REF, oci:DIR@sha256:HEX or docker://HOST[:PORT]/REPO[:TAG|@sha256:HEX]"
    );
}

/// The upload sessions whose bytes the registry still keeps for a repository.
fn uploaded_data(reg: &Registry, repo: &str) -> usize {
    let dir = reg
        .storage()
        .join("docker/registry/v2/repositories")
        .join(repo)
        .join("_uploads");
    std::fs::read_dir(dir).map_or(0, |d| {
        d.filter(|e| e.as_ref().unwrap().path().join("data").exists())
            .count()
    })
}

#[test]
fn a_failed_upload_cancels_its_session() {
    let tmp = testkit::tempdir();
    let (layout, _) = small_image(tmp.path(), 24);
    let m: serde_json::Value =
        serde_json::from_slice(&layout.read_blob(&small_manifest(&layout), None).unwrap()).unwrap();
    let victim: Digest = m["layers"][0]["digest"].as_str().unwrap().parse().unwrap();
    let path = layout.blob_path(&victim);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[100] ^= 0xff;
    std::fs::write(&path, &bytes).unwrap();
    let reg = Registry::plain();
    for (repo, extra) in [("whole", None), ("chunked", Some("65536"))] {
        let mut args = vec![
            "push".to_string(),
            app_src(&layout),
            reg.image(&format!("{repo}:1")),
            "--plain-http".into(),
        ];
        if let Some(chunk) = extra {
            args.extend(["--chunk-size".into(), chunk.into()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let err = fails(&args);
        assert!(err.contains("does not match its digest"), "{err}");
        let cancelled: Vec<String> = reg
            .requests()
            .into_iter()
            .filter(|r| r.starts_with(&format!("DELETE /v2/{repo}/blobs/uploads/")))
            .collect();
        assert_eq!(cancelled.len(), 1, "{repo}: {:?}", reg.requests());
        if extra.is_some() {
            // The session's state followed every chunk, so the registry takes the cancel.
            // (After a streamed PUT the state no longer matches what distribution 2.8 holds: it
            // answers the cancel 404 and keeps the bytes until its purge; docs/oci-registry.md.)
            assert!(cancelled[0].ends_with(" 204"), "{cancelled:?}");
            assert_eq!(uploaded_data(&reg, repo), 0, "{repo}: its bytes are gone");
        }
    }
}
