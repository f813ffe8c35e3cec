//! Tests: oci_referrers. What refers to an image (cosign signatures, SBOMs, attestations): carried
//! by `oci copy` and `oci push`, listed by `oci referrers`, made by `oci attach` and `oci sign`,
//! checked by `oci verify`; against real `docker-registry` processes (plain, and TLS that requires
//! a client certificate), the OCI 1.1 referrers API stand-in in front of one, skopeo as the peer
//! that copies the same image, and openssl as the independent signature oracle. The registries'
//! manifests and blobs are read and written by hand (plain HTTP, curl) to check what oci did.
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use testkit::oci::{get_blob, get_manifest, push_blob, put_manifest, sha256_digest, tags};
use testkit::pki::Pki;
use testkit::referrers_api::ReferrersApi;
use testkit::registry::{Fault, FaultProxy, Registry};

const SBOM: &str = "application/spdx+json";
const ATTESTATION: &str = "application/vnd.in-toto+json";
const SIMPLESIGNING: &str = "application/vnd.dev.cosign.simplesigning.v1+json";
const SIGNATURE_REFERRER: &str = "application/vnd.dev.cosign.artifact.sig.v1+json";
const SIGNATURE_ANNOTATION: &str = "dev.cosignproject.cosign/signature";
const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
const REF_NAME: &str = "org.opencontainers.image.ref.name";

fn oci(args: &[&str]) -> Command {
    testkit::oci::cli(args)
}

fn text(out: &[u8]) -> String {
    String::from_utf8(out.to_vec()).expect("UTF-8 output")
}

/// Runs oci expecting success; returns its stdout (trimmed) and its stderr.
fn run(args: &[&str]) -> (String, String) {
    let out: Output = testkit::output(&mut oci(args));
    assert!(
        out.status.success(),
        "oci {args:?} failed with {}\nstdout: {}\nstderr: {}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
    (text(&out.stdout).trim().to_string(), text(&out.stderr))
}

/// Runs oci expecting success and nothing on stderr; returns its stdout trimmed.
fn ok(args: &[&str]) -> String {
    let (out, err) = run(args);
    assert_eq!(err, "", "oci {args:?} said something on stderr");
    out
}

fn json(args: &[&str]) -> Value {
    serde_json::from_str(&ok(args)).expect("JSON output")
}

/// Runs oci expecting exit status 1 and one line on stderr; returns that line.
fn fails(args: &[&str]) -> String {
    let out = testkit::output(&mut oci(args));
    let err = text(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(1),
        "oci {args:?} should exit 1\nstdout: {}\nstderr: {err}",
        text(&out.stdout)
    );
    assert_eq!(err.lines().count(), 1, "one line expected: {err}");
    err.trim_end().to_string()
}

/// Runs a tool that must succeed; returns its stdout.
fn tool(cmd: &mut Command) -> String {
    testkit::ok(cmd)
}

/// A key pair made by openssl, and the key's name as oci prints it (SHA-256 of its DER).
struct Keys {
    key: PathBuf,
    public: PathBuf,
    id: String,
}

impl Keys {
    fn key(&self) -> &str {
        self.key.to_str().expect("a UTF-8 path")
    }

    fn public(&self) -> &str {
        self.public.to_str().expect("a UTF-8 path")
    }
}

/// An ECDSA P-256 key pair: `openssl genpkey` (PKCS#8) or, with `sec1`, `openssl ecparam -genkey`
/// (SEC1 with its EC PARAMETERS block first, as that command writes it).
fn keypair(dir: &Path, name: &str, sec1: bool) -> Keys {
    let key = dir.join(format!("{name}.key"));
    let public = dir.join(format!("{name}.pub"));
    if sec1 {
        tool(
            Command::new("openssl")
                .args(["ecparam", "-name", "prime256v1", "-genkey", "-out"])
                .arg(&key),
        );
    } else {
        tool(
            Command::new("openssl")
                .args([
                    "genpkey",
                    "-algorithm",
                    "EC",
                    "-pkeyopt",
                    "ec_paramgen_curve:P-256",
                    "-out",
                ])
                .arg(&key),
        );
    }
    tool(
        Command::new("openssl")
            .args(["pkey", "-pubout", "-in"])
            .arg(&key)
            .arg("-out")
            .arg(&public),
    );
    let der = testkit::output(
        Command::new("openssl")
            .args(["pkey", "-pubin", "-outform", "DER", "-in"])
            .arg(&public),
    )
    .stdout;
    assert_eq!(der.len(), 91, "a P-256 SubjectPublicKeyInfo is 91 bytes");
    Keys {
        key,
        public,
        id: sha256_digest(&der),
    }
}

/// `oci build` of a folder holding one file (`content`) into the layout `dir/NAME`, for
/// `platform`; returns the `oci:` reference of the image and its digest.
fn build(dir: &Path, name: &str, content: &str, platform: &str) -> (String, String) {
    let root = dir.join(format!("{name}-root"));
    std::fs::create_dir_all(root.join("etc")).unwrap();
    std::fs::write(root.join("etc/motd"), content).unwrap();
    let layout = dir.join(name);
    let digest = ok(&[
        "build",
        "--layout",
        layout.to_str().unwrap(),
        "--ref",
        "app",
        "--root",
        root.to_str().unwrap(),
        "--platform",
        platform,
    ]);
    (format!("oci:{}:app", layout.display()), digest)
}

/// The hex of a `sha256:` digest.
fn hex(digest: &str) -> &str {
    digest.strip_prefix("sha256:").expect("a sha256 digest")
}

/// The fallback tag that lists the referrers of `digest`.
fn fallback(digest: &str) -> String {
    format!("sha256-{}", hex(digest))
}

/// cosign's signature tag of `digest`.
fn sig_tag(digest: &str) -> String {
    format!("sha256-{}.sig", hex(digest))
}

/// A file to attach, written into `dir`.
fn file(dir: &Path, name: &str, body: &Value) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, serde_json::to_vec_pretty(body).unwrap()).unwrap();
    path
}

/// `oci attach` of `file` to `image` as `artifact_type`; returns the artifact's digest.
fn attach(image: &str, artifact_type: &str, file: &Path, extra: &[&str]) -> String {
    let mut args = vec![
        "attach",
        image,
        "--artifact-type",
        artifact_type,
        "--file",
        file.to_str().unwrap(),
        "--media-type",
        "application/json",
    ];
    args.extend_from_slice(extra);
    let digest = ok(&args);
    assert!(
        digest.starts_with("sha256:") && digest.len() == 71,
        "{digest}"
    );
    digest
}

/// An image in a registry with a signature, an SBOM and an attestation, all made by oci.
struct Signed {
    image: String,
    digest: String,
    /// The manifest under `sha256-<hex>.sig`.
    sig: String,
    sbom: String,
    att: String,
    keys: Keys,
}

/// Builds an image, pushes it to `image` (docker://...), signs it and attaches an SBOM and an
/// attestation to it; `extra` are the flags that reach the registry (`--plain-http`).
fn signed_image(dir: &Path, image: &str, extra: &[&str]) -> Signed {
    let (src, digest) = build(dir, "image", "signed image\n", "linux/amd64");
    let mut args = vec!["push", &src, image];
    args.extend_from_slice(extra);
    assert_eq!(ok(&args), digest);
    let keys = keypair(dir, "cosign", false);
    let mut args = vec!["sign", image, "--key", keys.key(), "--json"];
    args.extend_from_slice(extra);
    let signed = json(&args);
    assert_eq!(signed["image"], digest.as_str());
    assert_eq!(signed["key"], keys.id.as_str());
    let sig = signed["signatures"].as_str().unwrap().to_string();
    let sbom = file(
        dir,
        "sbom.spdx.json",
        &json!({"spdxVersion": "SPDX-2.3", "SPDXID": "SPDXRef-DOCUMENT", "name": "image"}),
    );
    let att = file(
        dir,
        "provenance.intoto.json",
        &json!({"_type": "https://in-toto.io/Statement/v1", "subject": [{"digest": {"sha256": hex(&digest)}}]}),
    );
    let sbom = attach(image, SBOM, &sbom, extra);
    let att = attach(image, ATTESTATION, &att, extra);
    Signed {
        image: image.to_string(),
        digest,
        sig,
        sbom,
        att,
        keys,
    }
}

/// What `oci referrers --json` says, as comparable rows (type, digest, media type, size, tag),
/// sorted.
fn rows(listing: &Value) -> Vec<(String, String, String, u64, Option<String>)> {
    let mut rows: Vec<_> = listing
        .as_array()
        .expect("an array")
        .iter()
        .map(|r| {
            (
                r["artifactType"].as_str().unwrap().to_string(),
                r["digest"].as_str().unwrap().to_string(),
                r["mediaType"].as_str().unwrap().to_string(),
                r["size"].as_u64().unwrap(),
                r["tag"].as_str().map(str::to_string),
            )
        })
        .collect();
    rows.sort();
    rows
}

/// The digests and artifact types a fallback index (or a referrers answer) lists, sorted.
fn listed(index: &[u8]) -> Vec<(String, String)> {
    let index: Value = serde_json::from_slice(index).expect("an index");
    assert_eq!(index["mediaType"], OCI_INDEX);
    let mut out: Vec<(String, String)> = index["manifests"]
        .as_array()
        .expect("manifests")
        .iter()
        .map(|d| {
            (
                d["digest"].as_str().unwrap().to_string(),
                d["artifactType"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect();
    out.sort();
    out
}

fn sorted(mut pairs: Vec<(String, String)>) -> Vec<(String, String)> {
    pairs.sort();
    pairs
}

/// The TLS flags for a client of `pki`'s registry.
fn tls_flags(pki: &Pki) -> [String; 6] {
    [
        "--tls-cert".into(),
        pki.client_cert.display().to_string(),
        "--tls-key".into(),
        pki.client_key.display().to_string(),
        "--tls-ca".into(),
        pki.ca_cert.display().to_string(),
    ]
}

/// curl (an independent client) GETs a manifest of a TLS registry with the client certificate;
/// `None` on 404.
fn curl_manifest(pki: &Pki, reg: &Registry, repo: &str, reference: &str) -> Option<Vec<u8>> {
    let out = testkit::output(
        Command::new("curl")
            .args(["-sS", "-f", "--cacert"])
            .arg(&pki.ca_cert)
            .arg("--cert")
            .arg(&pki.client_cert)
            .arg("--key")
            .arg(&pki.client_key)
            .args(["-H", &format!("Accept: {}", testkit::oci::MANIFEST_ACCEPT)])
            .arg(format!(
                "https://{}/v2/{repo}/manifests/{reference}",
                reg.host()
            )),
    );
    match out.status.code() {
        Some(0) => Some(out.stdout),
        // -f: an HTTP error at or over 400.
        Some(22) if text(&out.stderr).contains("404") => None,
        _ => panic!("curl {repo}:{reference}: {}", text(&out.stderr)),
    }
}

#[test]
fn a_signed_and_attached_image_copies_whole_to_a_mutual_tls_registry_and_a_repeat_moves_nothing() {
    let tmp = testkit::tempdir();
    let pki = Pki::new();
    let (a, b) = (Registry::plain(), Registry::tls(&pki));
    let s = signed_image(tmp.path(), &a.image("app:1"), &["--plain-http"]);
    let tls = tls_flags(&pki);
    let dst = b.image("mirror/app:1");
    let copy: Vec<&str> = [
        "copy",
        &s.image,
        &dst,
        "--src-plain-http",
        "--dest-tls-cert",
        &tls[1],
        "--dest-tls-key",
        &tls[3],
        "--dest-tls-ca",
        &tls[5],
        "--json",
    ]
    .to_vec();
    let report = json(&copy);
    assert_eq!(report["digest"], s.digest.as_str());
    assert_eq!(report["alreadyPresent"], false);
    let carried = &report["referrers"];
    assert_eq!(
        (
            carried["found"].as_u64(),
            carried["pushed"].as_u64(),
            carried["present"].as_u64(),
            carried["targetForm"].as_str(),
        ),
        (Some(3), Some(3), Some(0), Some("fallback-tag")),
        "{report:#}"
    );
    assert_eq!(carried["skipped"], json!([]));

    // B holds the very bytes A does, read by curl with the client certificate.
    for referrer in [&s.sbom, &s.att] {
        let theirs = get_manifest(a.addr, "app", referrer).expect("A holds it");
        let ours = curl_manifest(&pki, &b, "mirror/app", referrer);
        assert_eq!(ours.as_ref(), Some(&theirs), "{referrer} arrived as it was");
        let m: Value = serde_json::from_slice(&theirs).unwrap();
        assert_eq!(m["subject"]["digest"], s.digest.as_str());
        let layer = m["layers"][0]["digest"].as_str().unwrap();
        assert_eq!(
            carried_blob(&pki, &b, "mirror/app", layer),
            get_blob(a.addr, "app", layer)
        );
    }
    let sig_a = get_manifest(a.addr, "app", &sig_tag(&s.digest)).expect("A has the .sig tag");
    assert_eq!(sha256_digest(&sig_a), s.sig);
    assert_eq!(
        curl_manifest(&pki, &b, "mirror/app", &sig_tag(&s.digest)),
        Some(sig_a)
    );
    let index = curl_manifest(&pki, &b, "mirror/app", &fallback(&s.digest))
        .expect("B has the fallback tag");
    assert_eq!(
        listed(&index),
        sorted(vec![
            (s.sbom.clone(), SBOM.into()),
            (s.att.clone(), ATTESTATION.into())
        ])
    );

    // oci referrers says the same of both sides.
    let on_a = json(&["referrers", &s.image, "--plain-http", "--json"]);
    let mut args = vec!["referrers", &dst, "--json"];
    args.extend(tls.iter().map(String::as_str));
    let on_b = json(&args);
    assert_eq!(rows(&on_a), rows(&on_b));
    let types: Vec<(String, String, Option<String>)> = rows(&on_b)
        .into_iter()
        .map(|(t, d, _, _, tag)| (t, d, tag))
        .collect();
    let mut want = vec![
        (SBOM.to_string(), s.sbom.clone(), None),
        (ATTESTATION.to_string(), s.att.clone(), None),
        (
            SIMPLESIGNING.to_string(),
            s.sig.clone(),
            Some(sig_tag(&s.digest)),
        ),
    ];
    want.sort();
    assert_eq!(types, want);

    // The signature checks out on B.
    let mut args = vec!["verify", &dst, "--key", s.keys.public(), "--json"];
    args.extend(tls.iter().map(String::as_str));
    let verified = json(&args);
    assert_eq!(verified["image"], s.digest.as_str());
    assert_eq!(verified["key"], s.keys.id.as_str());
    assert_eq!(
        verified["foundIn"],
        format!("tag {}", sig_tag(&s.digest)).as_str()
    );

    // The second copy moves nothing: no blob byte, no manifest.
    let (uploads, posts, puts) = (
        b.blob_uploads(),
        b.count("POST /v2/mirror/app/blobs/uploads/"),
        b.count("PUT /v2/mirror/app/manifests/"),
    );
    assert_eq!(
        uploads, 7,
        "the image's 2 blobs and the referrers' 5, one request each"
    );
    let again = json(&copy);
    assert_eq!(
        (
            again["alreadyPresent"].as_bool(),
            again["bytesUploaded"].as_u64(),
            again["manifestsPushed"].as_u64(),
        ),
        (Some(true), Some(0), Some(0)),
        "{again:#}"
    );
    let carried = &again["referrers"];
    assert_eq!(
        (
            carried["found"].as_u64(),
            carried["pushed"].as_u64(),
            carried["present"].as_u64(),
            carried["bytesUploaded"].as_u64(),
            carried["blobsUploaded"].as_u64(),
        ),
        (Some(3), Some(0), Some(3), Some(0), Some(0)),
        "{again:#}"
    );
    assert_eq!(
        (
            b.blob_uploads(),
            b.count("POST /v2/mirror/app/blobs/uploads/"),
            b.count("PUT /v2/mirror/app/manifests/")
        ),
        (uploads, posts, puts),
        "the repeat sent no blob and no manifest:\n{:#?}",
        b.requests()
    );
}

/// A blob of a TLS registry, read by curl with the client certificate.
fn carried_blob(pki: &Pki, reg: &Registry, repo: &str, digest: &str) -> Vec<u8> {
    let out = tool(
        Command::new("curl")
            .args(["-sS", "-f", "-L", "--cacert"])
            .arg(&pki.ca_cert)
            .arg("--cert")
            .arg(&pki.client_cert)
            .arg("--key")
            .arg(&pki.client_key)
            .arg(format!("https://{}/v2/{repo}/blobs/{digest}", reg.host())),
    );
    assert_eq!(sha256_digest(out.as_bytes()), digest);
    out.into_bytes()
}

#[test]
fn bad_referrers_are_skipped_each_with_its_line_and_never_copied() {
    let tmp = testkit::tempdir();
    let dir = tmp.path();
    let (a, t) = (Registry::plain(), Registry::plain());
    let plain = ["--plain-http"];

    // (a) A manifest whose subject is another image, listed in this image's fallback index.
    let (x_src, x) = build(dir, "x", "image x\n", "linux/amd64");
    let (y_src, y) = build(dir, "y", "image y\n", "linux/amd64");
    ok(&["push", &x_src, &a.image("app:x"), "--plain-http"]);
    ok(&["push", &y_src, &a.image("app:y"), "--plain-http"]);
    let good = attach(
        &a.image("app:x"),
        SBOM,
        &file(dir, "x.spdx.json", &json!({"name": "x"})),
        &plain,
    );
    let stray = attach(
        &a.image("app:y"),
        SBOM,
        &file(dir, "y.spdx.json", &json!({"name": "y"})),
        &plain,
    );
    let stray_bytes = get_manifest(a.addr, "app", &stray).unwrap();
    let mut index: Value =
        serde_json::from_slice(&get_manifest(a.addr, "app", &fallback(&x)).unwrap()).unwrap();
    index["manifests"].as_array_mut().unwrap().push(json!({
        "mediaType": OCI_MANIFEST, "digest": stray, "size": stray_bytes.len(), "artifactType": SBOM,
    }));
    put_manifest(
        a.addr,
        "app",
        &fallback(&x),
        OCI_INDEX,
        &serde_json::to_vec(&index).unwrap(),
    );
    let line = format!(
        "oci: {}: {stray} listed as a referrer of {x} names subject {y}; skipped",
        a.image("app:x")
    );
    let (listing, err) = run(&["referrers", &a.image("app:x"), "--plain-http", "--json"]);
    assert_eq!(err, format!("{line}\n"));
    let listing: Value = serde_json::from_str(&listing).unwrap();
    assert_eq!(
        rows(&listing)
            .iter()
            .map(|r| r.1.as_str())
            .collect::<Vec<_>>(),
        [good.as_str()]
    );
    let (report, err) = run(&[
        "copy",
        &a.image("app:x"),
        &t.image("app:x"),
        "--plain-http",
        "--json",
    ]);
    assert_eq!(err, format!("{line}\n"));
    let report: Value = serde_json::from_str(&report).unwrap();
    assert_eq!(report["referrers"]["found"], 1);
    assert_eq!(report["referrers"]["pushed"], 1);
    assert_eq!(
        report["referrers"]["skipped"],
        json!([&line["oci: ".len()..]])
    );
    assert_eq!(get_manifest(t.addr, "app", &stray), None, "never copied");
    assert!(get_manifest(t.addr, "app", &good).is_some());
    assert_eq!(
        listed(&get_manifest(t.addr, "app", &fallback(&x)).unwrap()),
        [(good.clone(), SBOM.to_string())]
    );

    // (b) The fallback index of a multi-platform index lists its own platform manifests (as
    // oras once wrote it): they are the image's children, not referrers.
    let layout = dir.join("multi");
    let (_, amd) = build_into(&layout, dir, "amd", "linux/amd64");
    let (_, arm) = build_into(&layout, dir, "arm", "linux/arm64");
    let idx = ok(&[
        "index",
        "--layout",
        layout.to_str().unwrap(),
        "--ref",
        "multi",
        "--manifest",
        "amd",
        "arm",
    ]);
    let multi = format!("oci:{}:multi", layout.display());
    assert_eq!(
        ok(&["push", &multi, &a.image("multi:1"), "--plain-http"]),
        idx
    );
    let att = attach(
        &a.image("multi:1"),
        ATTESTATION,
        &file(dir, "multi.intoto.json", &json!({"_type": "statement"})),
        &plain,
    );
    let image_index: Value =
        serde_json::from_slice(&get_manifest(a.addr, "multi", &idx).unwrap()).unwrap();
    let children = image_index["manifests"].as_array().unwrap().clone();
    assert_eq!(
        children
            .iter()
            .map(|c| c["digest"].as_str().unwrap())
            .collect::<Vec<_>>(),
        [amd.as_str(), arm.as_str()]
    );
    let mut index: Value =
        serde_json::from_slice(&get_manifest(a.addr, "multi", &fallback(&idx)).unwrap()).unwrap();
    index["manifests"]
        .as_array_mut()
        .unwrap()
        .extend(children.iter().cloned());
    put_manifest(
        a.addr,
        "multi",
        &fallback(&idx),
        OCI_INDEX,
        &serde_json::to_vec(&index).unwrap(),
    );
    let lines: Vec<String> = [&amd, &arm]
        .iter()
        .map(|child| {
            format!(
                "oci: {}: {child} listed as a referrer of {idx} has no subject (an image's own manifest, not a referrer); skipped",
                a.image("multi:1")
            )
        })
        .collect();
    let (report, err) = run(&[
        "copy",
        &a.image("multi:1"),
        &t.image("multi:1"),
        "--plain-http",
        "--json",
    ]);
    assert_eq!(err.lines().collect::<Vec<_>>(), lines);
    let report: Value = serde_json::from_str(&report).unwrap();
    assert_eq!(report["digest"], idx.as_str());
    assert_eq!(
        (
            report["referrers"]["found"].as_u64(),
            report["referrers"]["pushed"].as_u64()
        ),
        (Some(1), Some(1))
    );
    assert_eq!(
        listed(&get_manifest(t.addr, "multi", &fallback(&idx)).unwrap()),
        [(att.clone(), ATTESTATION.to_string())],
        "the children are not listed as referrers at the target"
    );
    assert_eq!(tags(t.addr, "multi"), ["1".to_string(), fallback(&idx)]);

    // (c) The fallback tag holds an image manifest, not an index: ignored with its line; the
    // image's signature (a cosign tag) still comes along.
    let (z_src, z) = build(dir, "z", "image z\n", "linux/amd64");
    ok(&["push", &z_src, &a.image("app:z"), "--plain-http"]);
    let keys = keypair(dir, "z", false);
    ok(&[
        "sign",
        &a.image("app:z"),
        "--key",
        keys.key(),
        "--plain-http",
    ]);
    let y_bytes = get_manifest(a.addr, "app", &y).unwrap();
    put_manifest(a.addr, "app", &fallback(&z), OCI_MANIFEST, &y_bytes);
    let line = format!(
        "oci: {}: the fallback tag {} holds a {OCI_MANIFEST}, not an index of referrers; ignored",
        a.image("app:z"),
        fallback(&z)
    );
    let (report, err) = run(&[
        "copy",
        &a.image("app:z"),
        &t.image("app:z"),
        "--plain-http",
        "--json",
    ]);
    assert_eq!(err, format!("{line}\n"));
    let report: Value = serde_json::from_str(&report).unwrap();
    assert_eq!(
        (
            report["referrers"]["found"].as_u64(),
            report["referrers"]["pushed"].as_u64()
        ),
        (Some(1), Some(1)),
        "{report:#}"
    );
    assert!(
        !tags(t.addr, "app").contains(&fallback(&z)),
        "{:?}",
        tags(t.addr, "app")
    );
    ok(&[
        "verify",
        &t.image("app:z"),
        "--key",
        keys.public(),
        "--plain-http",
    ]);
}

/// `oci build` into the shared layout `layout` as `name`, for `platform`.
fn build_into(layout: &Path, dir: &Path, name: &str, platform: &str) -> (String, String) {
    let root = dir.join(format!("{name}-root"));
    std::fs::create_dir_all(&root).unwrap();
    std::fs::write(root.join("arch"), platform).unwrap();
    let digest = ok(&[
        "build",
        "--layout",
        layout.to_str().unwrap(),
        "--ref",
        name,
        "--root",
        root.to_str().unwrap(),
        "--platform",
        platform,
    ]);
    (format!("oci:{}:{name}", layout.display()), digest)
}

#[test]
fn a_target_that_lost_a_referrer_fails_the_comparison_naming_it() {
    let tmp = testkit::tempdir();
    let (a, t) = (Registry::plain(), Registry::plain());
    let s = signed_image(tmp.path(), &a.image("app:1"), &["--plain-http"]);
    let sbom_path: &'static str = Box::leak(format!("/manifests/{}", s.sbom).into_boxed_str());

    // The target answers 201 to the SBOM manifest's PUT without storing it: distribution 2.8
    // then refuses the fallback index that names it (it checks an index's manifests exist), and
    // the copy stops on that answer, before any comparison.
    let proxy = FaultProxy::start(t.addr, vec![Fault::new("PUT", sbom_path, 201, 1)]);
    let dst = proxy.image("app:1");
    assert_eq!(
        fails(&["copy", &s.image, &dst, "--plain-http"]),
        format!(
            "oci: registry {} answered 400 for /v2/app/manifests/{}: MANIFEST_BLOB_UNKNOWN blob unknown to registry",
            proxy.host(),
            fallback(&s.digest)
        )
    );
    assert_eq!((proxy.injected(), proxy.armed()), (1, 0));
    assert_eq!(get_manifest(t.addr, "app", &s.sbom), None);
    assert_eq!(get_manifest(t.addr, "app", &fallback(&s.digest)), None);

    // The target loses the SBOM between the copy's writes and its comparison: its HEAD of the
    // SBOM's manifest answers 404 (the first one, before the PUT, truly; the second, the
    // comparison's, as if it were gone). The copy fails naming what is missing.
    let t = Registry::plain();
    let proxy = FaultProxy::start(t.addr, vec![Fault::new("HEAD", sbom_path, 404, 2)]);
    let dst = proxy.image("app:1");
    let err = fails(&["copy", &s.image, &dst, "--plain-http"]);
    assert!(err.starts_with("oci: after the copy, "), "{err}");
    assert_eq!(
        err,
        format!(
            "oci: after the copy, {dst} lacks these referrers of the source: {} ({SBOM}); copy again, and check that nothing at the target deletes them",
            s.sbom
        )
    );
    assert_eq!((proxy.injected(), proxy.armed()), (2, 0));
    assert_eq!(t.count(&format!("PUT /v2/app/manifests/{} ", s.sbom)), 1);
    // Copying again, as the line says, finds everything there and passes.
    let again = json(&["copy", &s.image, &dst, "--plain-http", "--json"]);
    assert_eq!(
        (
            again["referrers"]["pushed"].as_u64(),
            again["referrers"]["present"].as_u64()
        ),
        (Some(0), Some(3)),
        "{again:#}"
    );

    // Truly lost: the target deletes the SBOM's manifest (its fallback index still names it).
    // The next copy puts it back.
    let r = testkit::oci::http(
        t.addr,
        "DELETE",
        &format!("/v2/app/manifests/{}", s.sbom),
        &[],
        b"",
    );
    assert_eq!(r.status, 202);
    assert_eq!(get_manifest(t.addr, "app", &s.sbom), None);
    let again = json(&["copy", &s.image, &dst, "--plain-http", "--json"]);
    assert_eq!(
        (
            again["referrers"]["pushed"].as_u64(),
            again["referrers"]["present"].as_u64()
        ),
        (Some(1), Some(2)),
        "{again:#}"
    );
    assert_eq!(
        get_manifest(t.addr, "app", &s.sbom),
        get_manifest(a.addr, "app", &s.sbom)
    );
}

#[test]
fn skopeo_copies_the_image_and_leaves_the_referrers_behind() {
    let tmp = testkit::tempdir();
    let (a, c) = (Registry::plain(), Registry::plain());
    let s = signed_image(tmp.path(), &a.image("app:1"), &["--plain-http"]);
    let version = tool(Command::new("skopeo").arg("--version"))
        .trim()
        .to_string();
    let skopeo = |extra: &[&str], dst: &str| {
        let mut cmd = Command::new("skopeo");
        cmd.args(["--insecure-policy"])
            .args(extra)
            .args([
                "copy",
                "--preserve-digests",
                "--src-tls-verify=false",
                "--dest-tls-verify=false",
            ])
            .arg(&s.image)
            .arg(dst);
        tool(&mut cmd);
    };
    // Default flags.
    skopeo(&[], &c.image("app:1"));
    let image = get_manifest(c.addr, "app", "1").expect("skopeo copied the image");
    assert_eq!(sha256_digest(&image), s.digest, "the image, byte for byte");
    assert_eq!(tags(c.addr, "app"), ["1"], "no .sig tag, no fallback tag");
    assert_eq!(get_manifest(c.addr, "app", &s.sbom), None);
    assert_eq!(get_manifest(c.addr, "app", &s.att), None);
    assert_eq!(get_manifest(c.addr, "app", &s.sig), None);
    assert_eq!(
        json(&["referrers", &c.image("app:1"), "--plain-http", "--json"]),
        json!([])
    );
    assert_eq!(
        fails(&[
            "verify",
            &c.image("app:1"),
            "--key",
            s.keys.public(),
            "--plain-http"
        ]),
        format!(
            "oci: {} has no signature (no tag sha256-HEX.sig and no signature referrer): sign it with oci sign --key KEY",
            c.image("app:1")
        )
    );

    // Its opt-in for cosign's tags (registries.d use-sigstore-attachments): the .sig comes along
    // (a manifest of its own making, with the same signature layer), the referrers still do not.
    let regd = tmp.path().join("registries.d");
    std::fs::create_dir_all(&regd).unwrap();
    std::fs::write(
        regd.join("default.yaml"),
        "default-docker:\n  use-sigstore-attachments: true\n",
    )
    .unwrap();
    skopeo(
        &["--registries.d", regd.to_str().unwrap()],
        &c.image("opt/app:1"),
    );
    assert_eq!(
        tags(c.addr, "opt/app"),
        ["1".to_string(), sig_tag(&s.digest)]
    );
    assert_eq!(get_manifest(c.addr, "opt/app", &s.sbom), None);
    assert_eq!(get_manifest(c.addr, "opt/app", &s.att), None);
    let theirs: Value =
        serde_json::from_slice(&get_manifest(c.addr, "opt/app", &sig_tag(&s.digest)).unwrap())
            .unwrap();
    let ours: Value =
        serde_json::from_slice(&get_manifest(a.addr, "app", &sig_tag(&s.digest)).unwrap()).unwrap();
    assert_eq!(
        theirs["layers"], ours["layers"],
        "the signature layer as is"
    );
    let sig_digest = sha256_digest(&get_manifest(c.addr, "opt/app", &sig_tag(&s.digest)).unwrap());
    // oci verifies the signature skopeo carried.
    let verified = json(&[
        "verify",
        &c.image("opt/app:1"),
        "--key",
        s.keys.public(),
        "--plain-http",
        "--json",
    ]);
    assert_eq!(verified["image"], s.digest.as_str());

    // oci copying over skopeo's copy adds what skopeo left behind, and not the image again.
    let report = json(&[
        "copy",
        &s.image,
        &c.image("app:1"),
        "--plain-http",
        "--json",
    ]);
    assert_eq!(report["alreadyPresent"], true);
    assert_eq!(
        (
            report["referrers"]["pushed"].as_u64(),
            report["referrers"]["present"].as_u64()
        ),
        (Some(3), Some(0))
    );
    let rewritten = if sig_digest == s.sig {
        "as it was at the source".to_string()
    } else {
        format!("rewritten: manifest {sig_digest}, the source's {}", s.sig)
    };
    eprintln!(
        "{version} copy, default flags: carried the image {} byte for byte; dropped the SBOM {}, the attestation {}, the fallback tag {} and the signature tag {}. With registries.d use-sigstore-attachments: true: carried the signature tag ({rewritten}; the same signature layer, which oci verify accepts); still dropped the SBOM, the attestation and the fallback tag.",
        s.digest,
        s.sbom,
        s.att,
        fallback(&s.digest),
        sig_tag(&s.digest),
    );
}

/// The payload cosign signs for `digest` in `HOST/REPO`, byte for byte.
fn cosign_payload(docker_reference: &str, digest: &str) -> String {
    format!(
        r#"{{"critical":{{"identity":{{"docker-reference":"{docker_reference}"}},"image":{{"docker-manifest-digest":"{digest}"}},"type":"cosign container image signature"}},"optional":null}}"#
    )
}

/// openssl's verdict on a DER signature of `payload` by the public key `public`.
fn openssl_verify(dir: &Path, public: &Path, payload: &[u8], der: &[u8]) -> (bool, String) {
    let (p, s) = (dir.join("payload.json"), dir.join("signature.der"));
    std::fs::write(&p, payload).unwrap();
    std::fs::write(&s, der).unwrap();
    let out = testkit::output(
        Command::new("openssl")
            .args(["dgst", "-sha256", "-verify"])
            .arg(public)
            .arg("-signature")
            .arg(&s)
            .arg(&p),
    );
    (
        out.status.success(),
        format!("{}{}", text(&out.stdout), text(&out.stderr)),
    )
}

fn b64(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn unb64(s: &str) -> Vec<u8> {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD
        .decode(s)
        .expect("base64")
}

#[test]
fn signatures_check_out_both_ways_with_openssl_as_the_oracle() {
    let tmp = testkit::tempdir();
    let dir = tmp.path();
    let a = Registry::plain();
    let (src, digest) = build(dir, "image", "to be signed\n", "linux/amd64");

    // (a) oci signs; openssl verifies what the registry holds.
    ok(&["push", &src, &a.image("app:1"), "--plain-http"]);
    let keys = keypair(dir, "oci", false);
    let signed = json(&[
        "sign",
        &a.image("app:1"),
        "--key",
        keys.key(),
        "--plain-http",
        "--json",
    ]);
    let bytes = get_manifest(a.addr, "app", &sig_tag(&digest)).expect("the .sig tag");
    assert_eq!(signed["signatures"], sha256_digest(&bytes).as_str());
    assert_eq!(signed.get("referrer"), None, "no referrers API here");
    let m: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(m["mediaType"], OCI_MANIFEST);
    assert_eq!(m["config"]["mediaType"], OCI_CONFIG);
    assert_eq!(
        m.get("subject"),
        None,
        "a cosign tag's manifest names no subject"
    );
    let layers = m["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 1);
    assert_eq!(layers[0]["mediaType"], SIMPLESIGNING);
    let payload = get_blob(a.addr, "app", layers[0]["digest"].as_str().unwrap());
    assert_eq!(layers[0]["size"], payload.len());
    assert_eq!(
        text(&payload),
        cosign_payload(&format!("{}/app", a.host()), &digest)
    );
    let der = unb64(
        layers[0]["annotations"][SIGNATURE_ANNOTATION]
            .as_str()
            .unwrap(),
    );
    let (verified, said) = openssl_verify(dir, &keys.public, &payload, &der);
    assert!(verified, "{said}");
    assert_eq!(said.trim(), "Verified OK");
    // The oracle can say no: the same signature over another image's payload.
    let other = cosign_payload(&format!("{}/app", a.host()), &sha256_digest(b"another"));
    let (verified, said) = openssl_verify(dir, &keys.public, other.as_bytes(), &der);
    assert!(!verified && said.contains("Verification failure"), "{said}");

    // (b) openssl signs, by hand, laid out as cosign's SIGNATURE_SPEC says; oci verifies.
    ok(&["push", &src, &a.image("hand:1"), "--plain-http"]);
    let hand = keypair(dir, "hand", true);
    let payload = cosign_payload(&format!("{}/hand", a.host()), &digest);
    std::fs::write(dir.join("hand-payload.json"), &payload).unwrap();
    let der = testkit::output(
        Command::new("openssl")
            .args(["dgst", "-sha256", "-sign"])
            .arg(&hand.key)
            .arg(dir.join("hand-payload.json")),
    )
    .stdout;
    assert_eq!(der[0], 0x30, "a DER SEQUENCE");
    let payload_digest = push_blob(a.addr, "hand", payload.as_bytes());
    // cosign's signature config: go-containerregistry's empty image with one layer.
    let config = serde_json::to_vec(&json!({
        "architecture": "", "created": "0001-01-01T00:00:00Z",
        "history": [{"created": "0001-01-01T00:00:00Z"}], "os": "",
        "rootfs": {"type": "layers", "diff_ids": [payload_digest]}, "config": {},
    }))
    .unwrap();
    let config_digest = push_blob(a.addr, "hand", &config);
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "size": config.len(), "digest": config_digest},
        "layers": [{
            "mediaType": SIMPLESIGNING, "size": payload.len(), "digest": payload_digest,
            "annotations": {SIGNATURE_ANNOTATION: b64(&der)},
        }],
    }))
    .unwrap();
    put_manifest(a.addr, "hand", &sig_tag(&digest), OCI_MANIFEST, &manifest);
    let verified = json(&[
        "verify",
        &a.image("hand:1"),
        "--key",
        hand.public(),
        "--plain-http",
        "--json",
    ]);
    assert_eq!(
        verified,
        json!({
            "image": digest, "key": hand.id, "payload": payload_digest,
            "foundIn": format!("tag {}", sig_tag(&digest)),
        })
    );
    // With both keys given, the one that signed is named.
    let line = ok(&[
        "verify",
        &a.image("hand:1"),
        "--key",
        keys.public(),
        "--key",
        hand.public(),
        "--plain-http",
    ]);
    assert_eq!(
        line,
        format!("{digest} signed by {} (tag {})", hand.id, sig_tag(&digest))
    );
    // oci signs with a SEC1 key too (what openssl ecparam -genkey writes), and openssl agrees.
    ok(&["push", &src, &a.image("sec1:1"), "--plain-http"]);
    ok(&[
        "sign",
        &a.image("sec1:1"),
        "--key",
        hand.key(),
        "--plain-http",
    ]);
    let m: Value =
        serde_json::from_slice(&get_manifest(a.addr, "sec1", &sig_tag(&digest)).unwrap()).unwrap();
    let payload = get_blob(a.addr, "sec1", m["layers"][0]["digest"].as_str().unwrap());
    let der = unb64(
        m["layers"][0]["annotations"][SIGNATURE_ANNOTATION]
            .as_str()
            .unwrap(),
    );
    assert!(openssl_verify(dir, &hand.public, &payload, &der).0);
}

#[test]
fn moved_truncated_and_foreign_signatures_and_unsigned_images_fail_with_their_line() {
    let tmp = testkit::tempdir();
    let dir = tmp.path();
    let a = Registry::plain();
    let keys = keypair(dir, "cosign", false);
    let mut images = Vec::new();
    for (i, name) in ["x", "y", "z", "u", "w"].iter().enumerate() {
        let (src, digest) = build(dir, name, &format!("image {i}\n"), "linux/amd64");
        ok(&[
            "push",
            &src,
            &a.image(&format!("app:{name}")),
            "--plain-http",
        ]);
        images.push(digest);
    }
    let [x, y, z, u, w] = [&images[0], &images[1], &images[2], &images[3], &images[4]];
    for name in ["app:x", "app:z", "app:w"] {
        ok(&["sign", &a.image(name), "--key", keys.key(), "--plain-http"]);
    }
    let x_sig = get_manifest(a.addr, "app", &sig_tag(x)).unwrap();
    let x_sig_json: Value = serde_json::from_slice(&x_sig).unwrap();
    let x_payload = x_sig_json["layers"][0]["digest"].as_str().unwrap();

    // (c) X's signature put under Y's tag: it signs X, not Y.
    put_manifest(a.addr, "app", &sig_tag(y), OCI_MANIFEST, &x_sig);
    assert_eq!(
        fails(&[
            "verify",
            &a.image("app:y"),
            "--key",
            keys.public(),
            "--plain-http"
        ]),
        format!(
            "oci: {} has no valid signature by {}: tag {} layer {x_payload}: it signs {x}, not this image ({y}): a signature moved from another image",
            a.image("app:y"),
            keys.id,
            sig_tag(y)
        )
    );

    // (d) Z's signature cut short: openssl refuses it, and so does oci, saying why.
    let mut z_sig: Value =
        serde_json::from_slice(&get_manifest(a.addr, "app", &sig_tag(z)).unwrap()).unwrap();
    let z_payload = z_sig["layers"][0]["digest"].as_str().unwrap().to_string();
    let der = unb64(
        z_sig["layers"][0]["annotations"][SIGNATURE_ANNOTATION]
            .as_str()
            .unwrap(),
    );
    let cut = &der[..der.len() - 9];
    let payload = get_blob(a.addr, "app", &z_payload);
    assert!(openssl_verify(dir, &keys.public, &payload, &der).0);
    assert!(!openssl_verify(dir, &keys.public, &payload, cut).0);
    z_sig["layers"][0]["annotations"][SIGNATURE_ANNOTATION] = b64(cut).into();
    put_manifest(
        a.addr,
        "app",
        &sig_tag(z),
        OCI_MANIFEST,
        &serde_json::to_vec(&z_sig).unwrap(),
    );
    assert_eq!(
        fails(&[
            "verify",
            &a.image("app:z"),
            "--key",
            keys.public(),
            "--plain-http"
        ]),
        format!(
            "oci: {} has no valid signature by {}: tag {} layer {z_payload}: its signature ({} bytes) is truncated or not an ASN.1 DER ECDSA signature",
            a.image("app:z"),
            keys.id,
            sig_tag(z),
            cut.len()
        )
    );

    // W's signature annotation is not base64.
    let mut w_sig: Value =
        serde_json::from_slice(&get_manifest(a.addr, "app", &sig_tag(w)).unwrap()).unwrap();
    let w_payload = w_sig["layers"][0]["digest"].as_str().unwrap().to_string();
    w_sig["layers"][0]["annotations"][SIGNATURE_ANNOTATION] = "not*base64!".into();
    put_manifest(
        a.addr,
        "app",
        &sig_tag(w),
        OCI_MANIFEST,
        &serde_json::to_vec(&w_sig).unwrap(),
    );
    assert_eq!(
        fails(&[
            "verify",
            &a.image("app:w"),
            "--key",
            keys.public(),
            "--plain-http"
        ]),
        format!(
            "oci: {} has no valid signature by {}: tag {} layer {w_payload}: its signature is not base64",
            a.image("app:w"),
            keys.id,
            sig_tag(w)
        )
    );

    // (f) Another key: X's own signature is not by it.
    let other = keypair(dir, "other", false);
    assert_eq!(
        fails(&[
            "verify",
            &a.image("app:x"),
            "--key",
            other.public(),
            "--plain-http"
        ]),
        format!(
            "oci: {} has no valid signature by {}: tag {} layer {x_payload}: it was made by none of these keys",
            a.image("app:x"),
            other.id,
            sig_tag(x)
        )
    );
    ok(&[
        "verify",
        &a.image("app:x"),
        "--key",
        keys.public(),
        "--plain-http",
    ]);
    // An image nobody signed.
    assert_eq!(
        fails(&[
            "verify",
            &a.image("app:u"),
            "--key",
            keys.public(),
            "--plain-http"
        ]),
        format!(
            "oci: {} has no signature (no tag sha256-HEX.sig and no signature referrer): sign it with oci sign --key KEY",
            a.image("app:u")
        )
    );
    assert_eq!(get_manifest(a.addr, "app", &sig_tag(u)), None);
}

#[test]
fn keys_in_the_wrong_format_are_refused_with_one_line_naming_the_file_and_nothing_is_pushed() {
    let tmp = testkit::tempdir();
    let dir = tmp.path();
    let a = Registry::plain();
    let (src, digest) = build(dir, "image", "unsigned\n", "linux/amd64");
    ok(&["push", &src, &a.image("app:1"), "--plain-http"]);
    let keys = keypair(dir, "good", false);
    let rsa = dir.join("rsa.key");
    tool(
        Command::new("openssl")
            .args([
                "genpkey",
                "-algorithm",
                "RSA",
                "-pkeyopt",
                "rsa_keygen_bits:2048",
                "-out",
            ])
            .arg(&rsa),
    );
    let rsa_pub = dir.join("rsa.pub");
    tool(
        Command::new("openssl")
            .args(["pkey", "-pubout", "-in"])
            .arg(&rsa)
            .arg("-out")
            .arg(&rsa_pub),
    );
    let p384 = dir.join("p384.key");
    tool(
        Command::new("openssl")
            .args([
                "genpkey",
                "-algorithm",
                "EC",
                "-pkeyopt",
                "ec_paramgen_curve:P-384",
                "-out",
            ])
            .arg(&p384),
    );
    let garbage = dir.join("garbage.key");
    std::fs::write(&garbage, "not a key at all\n").unwrap();
    let missing = dir.join("missing.key");
    let private =
        "an unencrypted ECDSA P-256 private key in PEM (BEGIN PRIVATE KEY or BEGIN EC PRIVATE KEY)";
    let make_private =
        "make one with openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out KEY";
    let public = "an ECDSA P-256 public key in PEM (BEGIN PUBLIC KEY)";
    let make_public = "make one with openssl pkey -in KEY -pubout -out KEY.pub";
    let image = a.image("app:1");
    let requests = a.requests().len();
    for (key, why) in [
        (&rsa, "it is not a P-256 key (WrongAlgorithm)".to_string()),
        (&p384, "it is not a P-256 key (WrongAlgorithm)".to_string()),
        (
            &garbage,
            "it has no -----BEGIN EC PRIVATE KEY----- line".to_string(),
        ),
    ] {
        let k = key.to_str().unwrap();
        assert_eq!(
            fails(&["sign", &image, "--key", k, "--plain-http"]),
            format!("oci: {k} is not {private}: {why}; {make_private}")
        );
    }
    // Each half of a pair where the other is wanted says which it is.
    let k = keys.public.to_str().unwrap();
    assert_eq!(
        fails(&["sign", &image, "--key", k, "--plain-http"]),
        format!(
            "oci: {k} is a public key, which only verifies: sign with the private key it was made from"
        )
    );
    let k = keys.key.to_str().unwrap();
    assert_eq!(
        fails(&["verify", &image, "--key", k, "--plain-http"]),
        format!(
            "oci: {k} is a private key: give the public key made from it (openssl pkey -in KEY -pubout -out KEY.pub)"
        )
    );
    let m = missing.to_str().unwrap();
    assert_eq!(
        fails(&["sign", &image, "--key", m, "--plain-http"]),
        format!("oci: cannot read key {m}: No such file or directory (os error 2)")
    );
    assert_eq!(
        a.requests().len(),
        requests,
        "a key refused before anything was sent: {:#?}",
        a.requests()
    );
    assert_eq!(tags(a.addr, "app"), ["1"], "nothing was pushed");
    let requests = a.requests().len();
    for (key, why) in [
        (
            &rsa_pub,
            "it is not a P-256 (prime256v1) key with an uncompressed point",
        ),
        (&garbage, "it has no -----BEGIN PUBLIC KEY----- line"),
    ] {
        let k = key.to_str().unwrap();
        assert_eq!(
            fails(&["verify", &image, "--key", k, "--plain-http"]),
            format!("oci: {k} is not {public}: {why}; {make_public}")
        );
    }
    assert_eq!(a.requests().len(), requests);
    // The good key still signs.
    ok(&["sign", &image, "--key", keys.key(), "--plain-http"]);
    assert_eq!(tags(a.addr, "app"), ["1".to_string(), sig_tag(&digest)]);
}

#[test]
fn with_the_referrers_api_artifacts_are_indexed_by_subject_and_copies_go_both_ways() {
    let tmp = testkit::tempdir();
    let dir = tmp.path();
    let reg = Registry::plain();
    let api = ReferrersApi::start(&reg);
    let s = signed_image(dir, &api.image("app:1"), &["--plain-http"]);
    let tags_dir = |repo: &str| {
        reg.storage()
            .join("docker/registry/v2/repositories")
            .join(repo)
            .join("_manifests/tags")
    };
    let stored_tags = |repo: &str| {
        let mut t: Vec<String> = std::fs::read_dir(tags_dir(repo))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        t.sort();
        t
    };
    // No fallback tag: the API indexes them.
    assert_eq!(
        stored_tags("app"),
        ["1".to_string(), sig_tag(&s.digest)],
        "no fallback tag {} in the storage",
        fallback(&s.digest)
    );
    assert_eq!(
        reg.count(&format!("PUT /v2/app/manifests/{} ", fallback(&s.digest))),
        0
    );
    assert!(
        api.queries()
            .iter()
            .any(|q| q.starts_with(&format!("/v2/app/referrers/{}", s.digest))),
        "{:?}",
        api.queries()
    );
    // The signature is also a referrer: the API lists it with the SBOM and the attestation.
    let answer = testkit::oci::http(
        api.addr,
        "GET",
        &format!("/v2/app/referrers/{}", s.digest),
        &[],
        b"",
    );
    assert_eq!(answer.status, 200);
    let by_api = listed(&answer.body);
    let sig_referrer = by_api
        .iter()
        .find(|(_, t)| t == SIGNATURE_REFERRER)
        .map(|(d, _)| d.clone())
        .expect("the signature as a referrer");
    assert_eq!(
        by_api,
        sorted(vec![
            (s.sbom.clone(), SBOM.into()),
            (s.att.clone(), ATTESTATION.into()),
            (sig_referrer.clone(), SIGNATURE_REFERRER.into()),
        ])
    );
    let referrer: Value =
        serde_json::from_slice(&get_manifest(reg.addr, "app", &sig_referrer).unwrap()).unwrap();
    let tagged: Value =
        serde_json::from_slice(&get_manifest(reg.addr, "app", &s.sig).unwrap()).unwrap();
    assert_eq!(referrer["subject"]["digest"], s.digest.as_str());
    assert_eq!(
        referrer["layers"], tagged["layers"],
        "the same signed payload"
    );
    let source_rows = rows(&json(&["referrers", &s.image, "--plain-http", "--json"]));
    assert_eq!(source_rows.len(), 4, "{source_rows:#?}");
    let verified = json(&[
        "verify",
        &s.image,
        "--key",
        s.keys.public(),
        "--plain-http",
        "--json",
    ]);
    assert_eq!(verified["image"], s.digest.as_str());

    // To a registry without the API: the fallback tag lists the three that name a subject.
    let f = Registry::plain();
    let report = json(&[
        "copy",
        &s.image,
        &f.image("app:1"),
        "--plain-http",
        "--json",
    ]);
    let carried = &report["referrers"];
    assert_eq!(
        (
            carried["found"].as_u64(),
            carried["pushed"].as_u64(),
            carried["targetForm"].as_str()
        ),
        (Some(4), Some(4), Some("fallback-tag")),
        "{report:#}"
    );
    assert_eq!(
        listed(&get_manifest(f.addr, "app", &fallback(&s.digest)).unwrap()),
        by_api
    );
    assert_eq!(
        rows(&json(&[
            "referrers",
            &f.image("app:1"),
            "--plain-http",
            "--json"
        ])),
        source_rows
    );
    // And back, into another repository behind the API: no fallback tag written there.
    let report = json(&[
        "copy",
        &f.image("app:1"),
        &api.image("back:1"),
        "--plain-http",
        "--json",
    ]);
    let carried = &report["referrers"];
    assert_eq!(
        (
            carried["found"].as_u64(),
            carried["pushed"].as_u64(),
            carried["targetForm"].as_str()
        ),
        (Some(4), Some(4), Some("api")),
        "{report:#}"
    );
    assert_eq!(stored_tags("back"), ["1".to_string(), sig_tag(&s.digest)]);
    let answer = testkit::oci::http(
        api.addr,
        "GET",
        &format!("/v2/back/referrers/{}", s.digest),
        &[],
        b"",
    );
    assert_eq!(listed(&answer.body), by_api);
    assert_eq!(
        rows(&json(&[
            "referrers",
            &api.image("back:1"),
            "--plain-http",
            "--json"
        ])),
        source_rows
    );
    ok(&[
        "verify",
        &api.image("back:1"),
        "--key",
        s.keys.public(),
        "--plain-http",
    ]);
}

#[test]
fn copies_into_layouts_carry_referrers_all_none_or_one_type() {
    let tmp = testkit::tempdir();
    let dir = tmp.path();
    let a = Registry::plain();
    let s = signed_image(dir, &a.image("app:1"), &["--plain-http"]);
    let index_of = |layout: &Path| -> Vec<Value> {
        let index: Value =
            serde_json::from_slice(&std::fs::read(layout.join("index.json")).unwrap()).unwrap();
        index["manifests"].as_array().unwrap().clone()
    };
    // Each entry as (digest, ref name), sorted.
    let entries = |layout: &Path| -> Vec<(String, Option<String>)> {
        let mut e: Vec<_> = index_of(layout)
            .iter()
            .map(|d| {
                (
                    d["digest"].as_str().unwrap().to_string(),
                    d["annotations"][REF_NAME].as_str().map(str::to_string),
                )
            })
            .collect();
        e.sort();
        e
    };

    // All of them: the subject's referrers untagged, cosign's tag as a ref name.
    let all = dir.join("all");
    let dst = format!("oci:{}:v1", all.display());
    let report = json(&["copy", &s.image, &dst, "--plain-http", "--json"]);
    assert_eq!(report["referrers"]["targetForm"], "layout");
    assert_eq!(report["referrers"]["pushed"], 3);
    let mut want = vec![
        (s.digest.clone(), Some("v1".to_string())),
        (s.sbom.clone(), None),
        (s.att.clone(), None),
        (s.sig.clone(), Some(sig_tag(&s.digest))),
    ];
    want.sort();
    assert_eq!(entries(&all), want);
    for d in index_of(&all) {
        let digest = d["digest"].as_str().unwrap();
        let blob = std::fs::read(all.join("blobs/sha256").join(hex(digest))).unwrap();
        assert_eq!(
            Some(blob),
            get_manifest(a.addr, "app", digest),
            "{digest} as the registry holds it"
        );
    }
    // skopeo reads the signature under its ref name.
    let raw = tool(Command::new("skopeo").args([
        "inspect",
        "--raw",
        &format!("oci:{}:{}", all.display(), sig_tag(&s.digest)),
    ]));
    assert_eq!(sha256_digest(raw.as_bytes()), s.sig);
    let verified = json(&["verify", &dst, "--key", s.keys.public(), "--json"]);
    assert_eq!(verified["image"], s.digest.as_str());
    assert_eq!(
        rows(&json(&["referrers", &dst, "--json"]))
            .into_iter()
            .map(|r| (r.0, r.1, r.4))
            .collect::<Vec<_>>(),
        rows(&json(&["referrers", &s.image, "--plain-http", "--json"]))
            .into_iter()
            .map(|r| (r.0, r.1, r.4))
            .collect::<Vec<_>>()
    );
    // And from the layout to another registry: they come along with the push.
    let b = Registry::plain();
    let report = json(&["push", &dst, &b.image("app:1"), "--plain-http", "--json"]);
    assert_eq!(report["referrers"]["pushed"], 3, "{report:#}");
    ok(&[
        "verify",
        &b.image("app:1"),
        "--key",
        s.keys.public(),
        "--plain-http",
    ]);

    // --no-referrers: the image alone.
    let none = dir.join("none");
    let dst = format!("oci:{}:v1", none.display());
    let report = json(&[
        "copy",
        &s.image,
        &dst,
        "--plain-http",
        "--no-referrers",
        "--json",
    ]);
    assert_eq!(report.get("referrers"), None);
    assert_eq!(entries(&none), [(s.digest.clone(), Some("v1".to_string()))]);
    assert_eq!(
        fails(&["verify", &dst, "--key", s.keys.public()]),
        format!(
            "oci: {dst} has no signature (no tag sha256-HEX.sig and no signature referrer): sign it with oci sign --key KEY"
        )
    );

    // --artifact-type: the SBOM alone.
    let sbom = dir.join("sbom");
    let dst = format!("oci:{}:v1", sbom.display());
    let report = json(&[
        "copy",
        &s.image,
        &dst,
        "--plain-http",
        "--artifact-type",
        SBOM,
        "--json",
    ]);
    assert_eq!(
        (
            report["referrers"]["found"].as_u64(),
            report["referrers"]["pushed"].as_u64()
        ),
        (Some(1), Some(1))
    );
    let mut want = vec![
        (s.digest.clone(), Some("v1".to_string())),
        (s.sbom.clone(), None),
    ];
    want.sort();
    assert_eq!(entries(&sbom), want);
    let sbom_entry = index_of(&sbom)
        .into_iter()
        .find(|d| d["digest"] == s.sbom.as_str())
        .unwrap();
    assert_eq!(sbom_entry["artifactType"], SBOM);
}

#[test]
fn a_second_signers_layer_at_the_target_is_kept_and_what_refers_to_a_referrer_comes_along() {
    let tmp = testkit::tempdir();
    let dir = tmp.path();
    let (a, b) = (Registry::plain(), Registry::plain());
    let s = signed_image(dir, &a.image("app:1"), &["--plain-http"]);
    // The SBOM signed, and a note attached to it: referrers at depth 1.
    let sbom_ref = a.image(&format!("app@{}", s.sbom));
    ok(&["sign", &sbom_ref, "--key", s.keys.key(), "--plain-http"]);
    let note = attach(
        &sbom_ref,
        "application/vnd.example.note",
        &file(dir, "note.json", &json!({"reviewed": true})),
        &["--plain-http"],
    );
    // The target has the image already, signed there by another key.
    let dst = b.image("app:1");
    ok(&["copy", &s.image, &dst, "--plain-http", "--no-referrers"]);
    let other = keypair(dir, "other", false);
    ok(&["sign", &dst, "--key", other.key(), "--plain-http"]);

    let report = json(&["copy", &s.image, &dst, "--plain-http", "--json"]);
    assert_eq!(
        (
            report["referrers"]["found"].as_u64(),
            report["referrers"]["pushed"].as_u64()
        ),
        (Some(5), Some(5)),
        "{report:#}"
    );
    let theirs: Value =
        serde_json::from_slice(&get_manifest(a.addr, "app", &sig_tag(&s.digest)).unwrap()).unwrap();
    let ours: Value =
        serde_json::from_slice(&get_manifest(b.addr, "app", &sig_tag(&s.digest)).unwrap()).unwrap();
    let layers = ours["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 2, "both signers' layers: {ours:#}");
    assert_eq!(layers[1], theirs["layers"][0], "the source's appended");
    for keys in [&s.keys, &other] {
        let verified = json(&[
            "verify",
            &dst,
            "--key",
            keys.public(),
            "--plain-http",
            "--json",
        ]);
        assert_eq!(verified["key"], keys.id.as_str());
    }
    // What refers to the SBOM arrived: its signature under its cosign tag, the note listed under
    // the SBOM's fallback tag.
    let sbom_at_b = b.image(&format!("app@{}", s.sbom));
    ok(&[
        "verify",
        &sbom_at_b,
        "--key",
        s.keys.public(),
        "--plain-http",
    ]);
    assert_eq!(
        listed(&get_manifest(b.addr, "app", &fallback(&s.sbom)).unwrap()),
        [(note.clone(), "application/vnd.example.note".to_string())]
    );
    let depths: Vec<(String, u64)> = json(&["referrers", &dst, "--plain-http", "--json"])
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["digest"].as_str().unwrap().to_string(),
                r["depth"].as_u64().unwrap(),
            )
        })
        .filter(|(_, depth)| *depth == 1)
        .collect();
    assert_eq!(depths.len(), 2, "{depths:?}");
    assert!(depths.iter().any(|(d, _)| *d == note));
    // A repeat finds all five there and writes nothing.
    let puts = b.count("PUT /v2/app/manifests/");
    let again = json(&["copy", &s.image, &dst, "--plain-http", "--json"]);
    assert_eq!(
        (
            again["referrers"]["pushed"].as_u64(),
            again["referrers"]["present"].as_u64(),
            again["referrers"]["bytesUploaded"].as_u64()
        ),
        (Some(0), Some(5), Some(0))
    );
    assert_eq!(b.count("PUT /v2/app/manifests/"), puts);
}

#[test]
fn referrers_of_an_index_list_those_of_each_platforms_manifest_with_their_subject() {
    let tmp = testkit::tempdir();
    let dir = tmp.path();
    let layout = dir.join("multi");
    let (amd_ref, amd) = build_into(&layout, dir, "amd", "linux/amd64");
    let (_, arm) = build_into(&layout, dir, "arm", "linux/arm64");
    let idx = ok(&[
        "index",
        "--layout",
        layout.to_str().unwrap(),
        "--ref",
        "multi",
        "--manifest",
        "amd",
        "arm",
    ]);
    let multi = format!("oci:{}:multi", layout.display());
    let att = attach(
        &multi,
        ATTESTATION,
        &file(dir, "multi.intoto.json", &json!({"_type": "statement"})),
        &[],
    );
    let sbom = attach(
        &amd_ref,
        SBOM,
        &file(dir, "amd.spdx.json", &json!({"spdxVersion": "SPDX-2.3"})),
        &[],
    );
    let listing = json(&["referrers", &multi, "--json"]);
    let mut got: Vec<(String, String, String)> = listing
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["digest"].as_str().unwrap().to_string(),
                r["artifactType"].as_str().unwrap().to_string(),
                r["subject"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    got.sort();
    let mut want = vec![
        (att.clone(), ATTESTATION.to_string(), idx.clone()),
        (sbom.clone(), SBOM.to_string(), amd.clone()),
    ];
    want.sort();
    assert_eq!(got, want, "the arm64 manifest ({arm}) has none");
    // In text, what refers to a platform's manifest names it; what refers to the index does not.
    let text = ok(&["referrers", &multi]);
    let line = |digest: &str| {
        text.lines()
            .find(|l| l.contains(digest))
            .unwrap_or_else(|| panic!("{digest} listed: {text}"))
            .to_string()
    };
    assert!(line(&sbom).contains(&format!(" subject={amd}")), "{text}");
    assert!(!line(&att).contains("subject="), "{text}");
    // One type only: the platform's SBOM.
    let only = json(&["referrers", &multi, "--artifact-type", SBOM, "--json"]);
    assert_eq!(only.as_array().unwrap().len(), 1);
    assert_eq!(only[0]["digest"], sbom.as_str());
}
