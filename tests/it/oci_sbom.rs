//! Tests: `oci build --sbom`, an SPDX 2.3 SBOM of the layer's files attached to the image as a
//! referrer; checked against the files on disk, `sha1sum` and the SPDX project's `pyspdxtools`.
use serde_json::Value;
use sha2::{Digest as _, Sha256};
use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::{Path, PathBuf};
use std::process::Command;
use testkit::oci::{snapshot, tree, workspace_root};
use testkit::{fails, ok, tempdir};

fn oci() -> Command {
    let mut c = testkit::cmd("oci");
    c.env_remove("SOURCE_DATE_EPOCH");
    c
}

/// `oci build --json` of `root` into `layout` as `name`, with extra flags.
fn build(layout: &Path, name: &str, root: &Path, extra: &[&str]) -> Value {
    let out = ok(oci()
        .arg("build")
        .arg("--layout")
        .arg(layout)
        .args(["--ref", name])
        .arg("--root")
        .arg(root)
        .args(extra)
        .arg("--json"));
    serde_json::from_str(&out).expect("JSON output")
}

fn blob(layout: &Path, digest: &str) -> Vec<u8> {
    let hex = digest.strip_prefix("sha256:").expect("a sha256 digest");
    fs::read(layout.join("blobs/sha256").join(hex)).expect("the blob is in the layout")
}

fn blob_json(layout: &Path, digest: &str) -> Value {
    serde_json::from_slice(&blob(layout, digest)).expect("a JSON blob")
}

/// The SBOM document a build attached: its artifact manifest's only layer.
fn sbom_of(layout: &Path, built: &Value) -> Vec<u8> {
    let manifest = blob_json(layout, built["sbom"]["digest"].as_str().unwrap());
    blob(layout, manifest["layers"][0]["digest"].as_str().unwrap())
}

const NON_UTF8: &[u8] = b"caf\xe9.txt";

/// The committed fixture plus what git cannot keep (hardlinks, symlinks, odd modes, a non-UTF-8
/// name), copied under `umask`, every mode then set explicitly and every mtime set to `mtime`.
fn make_tree(dir: &Path, umask: &str, mtime: &str) {
    let fixture = workspace_root().join("tests/fixtures/oci-golden");
    ok(Command::new("sh")
        .arg("-c")
        .arg(format!("umask {umask} && cp -r \"$0\" \"$1\""))
        .arg(&fixture)
        .arg(dir));
    fs::create_dir_all(dir.join("empty")).unwrap();
    symlink("run.sh", dir.join("bin/run-link")).unwrap();
    fs::hard_link(
        dir.join("data/blob.bin"),
        dir.join("data/blob-hardlink.bin"),
    )
    .unwrap();
    fs::write(dir.join(OsStr::from_bytes(NON_UTF8)), "not UTF-8\n").unwrap();
    set_modes(dir, dir);
    ok(Command::new("find")
        .arg(dir)
        .args(["-exec", "touch", "-h", "-d", mtime, "{}", "+"]));
}

fn set_modes(root: &Path, dir: &Path) {
    for e in fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let m = fs::symlink_metadata(&p).unwrap();
        let mode = match p.strip_prefix(root).unwrap().to_str() {
            Some("bin/run.sh") => 0o4755,
            Some("etc/app/app.conf") => 0o600,
            _ if m.is_dir() => 0o755,
            _ => 0o644,
        };
        if m.file_type().is_symlink() {
            continue;
        }
        fs::set_permissions(&p, fs::Permissions::from_mode(mode)).unwrap();
        if m.is_dir() {
            set_modes(root, &p);
        }
    }
    fs::set_permissions(dir, fs::Permissions::from_mode(0o755)).unwrap();
}

#[test]
fn two_checkouts_give_one_image_and_one_sbom_digest() {
    let tmp = tempdir();
    let a = tmp.path().join("a");
    let b = tmp.path().join("somewhere/else/entirely/b");
    fs::create_dir_all(b.parent().unwrap()).unwrap();
    make_tree(&a, "022", "@1234567890");
    make_tree(&b, "077", "@1700000000");
    let one = build(
        &tmp.path().join("layout-a"),
        "app",
        &a,
        &["--sbom", "--threads", "1"],
    );
    let other = build(
        &tmp.path().join("layout-b"),
        "app",
        &b,
        &["--sbom", "--threads", "3"],
    );
    assert_eq!(one["manifest"], other["manifest"], "one image digest");
    assert_eq!(one["sbom"], other["sbom"], "one SBOM manifest digest");
    let sbom = sbom_of(&tmp.path().join("layout-a"), &one);
    assert_eq!(sbom, sbom_of(&tmp.path().join("layout-b"), &other));
    let text = String::from_utf8_lossy(&sbom);
    assert!(
        !text.contains(tmp.path().to_str().unwrap()),
        "no host path in the SBOM: {text}"
    );
    eprintln!(
        "image {} sbom {}",
        one["manifest"]["digest"], one["sbom"]["digest"]
    );

    // --sbom adds a referrer and changes nothing of the image itself.
    let plain = build(&tmp.path().join("layout-c"), "app", &a, &[]);
    assert_eq!(plain["manifest"], one["manifest"]);
    assert!(plain.get("sbom").is_none(), "no sbom field without --sbom");
    let index = fs::read_to_string(tmp.path().join("layout-c/index.json")).unwrap();
    assert!(
        !index.contains("spdx"),
        "no referrer without --sbom: {index}"
    );

    // SOURCE_DATE_EPOCH dates the SBOM, and so changes its digest.
    let mut stamped = oci();
    stamped.env("SOURCE_DATE_EPOCH", "1700000000");
    let layout = tmp.path().join("layout-d");
    let out = ok(stamped
        .args(["build", "--ref", "app", "--sbom"])
        .arg("--layout")
        .arg(&layout)
        .arg("--root")
        .arg(&a));
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2, "the image digest, then the SBOM's: {out}");
    assert_ne!(lines[1], one["sbom"]["digest"].as_str().unwrap());
    let manifest = blob_json(&layout, lines[1]);
    assert_eq!(
        manifest["annotations"]["org.opencontainers.image.created"],
        "2023-11-14T22:13:20Z"
    );
    let doc: Value = serde_json::from_slice(&blob(
        &layout,
        manifest["layers"][0]["digest"].as_str().unwrap(),
    ))
    .unwrap();
    assert_eq!(doc["creationInfo"]["created"], "2023-11-14T22:13:20Z");
}

/// `sha1sum` of a file, read on its standard input (so odd names never reach its output).
fn sha1sum(path: &Path) -> String {
    let input = fs::File::open(path).unwrap();
    let out = ok(Command::new("sha1sum").stdin(input));
    out.split_whitespace().next().unwrap().to_string()
}

#[test]
fn the_sbom_lists_exactly_the_layers_files_with_their_sums_sizes_and_modes() {
    let tmp = tempdir();
    let root = tmp.path().join("root");
    make_tree(&root, "022", "@0");
    let layout = tmp.path().join("layout");
    let built = build(&layout, "app", &root, &["--sbom", "--prefix", "/opt/app"]);
    let doc: Value = serde_json::from_slice(&sbom_of(&layout, &built)).unwrap();

    // What the SBOM says: name -> (sha1, sha256, comment).
    let mut listed = BTreeMap::new();
    for f in doc["files"].as_array().unwrap() {
        let sums: BTreeMap<&str, &str> = f["checksums"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| {
                (
                    c["algorithm"].as_str().unwrap(),
                    c["checksumValue"].as_str().unwrap(),
                )
            })
            .collect();
        let name = f["fileName"].as_str().unwrap().to_string();
        let entry = (
            sums["SHA1"].to_string(),
            sums["SHA256"].to_string(),
            f["comment"].as_str().unwrap().to_string(),
        );
        assert!(listed.insert(name, entry).is_none(), "each file once");
    }

    // What is on disk: every regular file (hardlinks each under their name), nothing else.
    let mut want = BTreeMap::new();
    for (rel, node) in tree(&root) {
        if node.kind != 'f' {
            continue;
        }
        let path = root.join(OsStr::from_bytes(&rel));
        let name = format!("./opt/app/{}", String::from_utf8_lossy(&rel));
        let comment = format!("size {} mode {:04o}", node.bytes.len(), node.mode);
        let sha256 = hex::encode(Sha256::digest(&node.bytes));
        want.insert(name, (sha1sum(&path), sha256, comment));
    }
    assert_eq!(listed, want, "the SBOM lists the files on disk");
    assert!(want.contains_key("./opt/app/data/blob-hardlink.bin"));
    assert!(want.contains_key("./opt/app/caf\u{fffd}.txt"));
    assert_eq!(
        want["./opt/app/bin/run.sh"].2,
        format!(
            "size {} mode 4755",
            fs::metadata(root.join("bin/run.sh")).unwrap().len()
        )
    );

    // The package verification code, recomputed from the files' SHA-1s.
    let mut sha1s: Vec<String> = want.values().map(|(s, _, _)| s.clone()).collect();
    sha1s.sort();
    let input = tmp.path().join("sha1s");
    fs::write(&input, sha1s.concat()).unwrap();
    let image = &doc["packages"][0];
    assert_eq!(
        image["packageVerificationCode"]["packageVerificationCodeValue"],
        sha1sum(&input)
    );
    assert_eq!(image["name"], "app");
    assert_eq!(
        format!(
            "sha256:{}",
            image["checksums"][0]["checksumValue"].as_str().unwrap()
        ),
        built["manifest"]["digest"].as_str().unwrap()
    );
    let contains = doc["relationships"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["relationshipType"] == "CONTAINS" && r["spdxElementId"] == "SPDXRef-Image")
        .count();
    assert_eq!(contains, want.len(), "the image CONTAINS every file");
}

fn pyspdxtools(file: &Path) {
    let out = Command::new("pyspdxtools")
        .arg("-i")
        .arg(file)
        .output()
        .expect("pyspdxtools runs: `pip install spdx-tools` (cargo xtask ci does)");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && !stderr.contains("invalid"),
        "pyspdxtools refused {}: {stderr}{}",
        file.display(),
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn pyspdxtools_validates_the_sbom_with_and_without_a_base() {
    let tmp = tempdir();
    let root = tmp.path().join("root");
    make_tree(&root, "022", "@0");
    let empty = tmp.path().join("empty");
    fs::create_dir(&empty).unwrap();
    let layout = tmp.path().join("layout");
    let base = build(&layout, "base", &root, &["--sbom"]);
    let app = build(
        &layout,
        "app",
        &empty,
        &[
            "--sbom",
            "--base-layout",
            layout.to_str().unwrap(),
            "--base-ref",
            "base",
        ],
    );
    for (name, built) in [("base", &base), ("app", &app)] {
        // pyspdxtools tells the format by the file's extension.
        let file = tmp.path().join(format!("{name}.spdx.json"));
        fs::write(&file, sbom_of(&layout, built)).unwrap();
        pyspdxtools(&file);
    }
    let doc: Value = serde_json::from_slice(&sbom_of(&layout, &app)).unwrap();
    assert_eq!(
        doc["files"],
        serde_json::json!([]),
        "the new layer is empty"
    );
    let base_package = &doc["packages"][1];
    assert_eq!(base_package["name"], "base");
    assert_eq!(
        format!(
            "sha256:{}",
            base_package["checksums"][0]["checksumValue"]
                .as_str()
                .unwrap()
        ),
        base["manifest"]["digest"].as_str().unwrap()
    );
    assert!(
        doc["relationships"].as_array().unwrap().iter().any(|r| {
            r["spdxElementId"] == "SPDXRef-Image"
                && r["relationshipType"] == "DESCENDANT_OF"
                && r["relatedSpdxElement"] == "SPDXRef-Base"
        }),
        "the image descends from its base"
    );
}

#[test]
fn the_sbom_is_an_untagged_referrer_of_the_image_in_index_json() {
    let tmp = tempdir();
    let root = tmp.path().join("root");
    make_tree(&root, "022", "@0");
    let layout = tmp.path().join("layout");
    let built = build(&layout, "app", &root, &["--sbom"]);
    // Built again: the ref and the referrer are each listed once.
    assert_eq!(build(&layout, "app", &root, &["--sbom"]), built);
    let image = &built["manifest"];
    let sbom = &built["sbom"];
    let index: Value =
        serde_json::from_slice(&fs::read(layout.join("index.json")).unwrap()).unwrap();
    let entries = index["manifests"].as_array().unwrap();
    assert_eq!(entries.len(), 2, "{index}");
    let untagged: Vec<&Value> = entries
        .iter()
        .filter(|d| d.get("annotations").is_none())
        .collect();
    assert_eq!(untagged.len(), 1);
    assert_eq!(untagged[0], sbom);
    assert_eq!(sbom["artifactType"], "application/spdx+json");
    assert_eq!(
        sbom["mediaType"],
        "application/vnd.oci.image.manifest.v1+json"
    );

    let manifest_bytes = blob(&layout, sbom["digest"].as_str().unwrap());
    assert_eq!(manifest_bytes.len() as u64, sbom["size"].as_u64().unwrap());
    let manifest: Value = serde_json::from_slice(&manifest_bytes).unwrap();
    assert_eq!(manifest["artifactType"], "application/spdx+json");
    assert_eq!(
        manifest["config"],
        serde_json::json!({
            "mediaType": "application/vnd.oci.empty.v1+json",
            "digest": "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a",
            "size": 2,
            "data": "e30="
        })
    );
    assert_eq!(
        blob(&layout, manifest["config"]["digest"].as_str().unwrap()),
        b"{}"
    );
    assert_eq!(manifest["subject"], *image, "the subject is the image");
    let layers = manifest["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 1);
    assert_eq!(layers[0]["mediaType"], "application/spdx+json");
    let doc = blob(&layout, layers[0]["digest"].as_str().unwrap());
    assert_eq!(doc.len() as u64, layers[0]["size"].as_u64().unwrap());
    assert_eq!(
        format!("sha256:{}", hex::encode(Sha256::digest(&doc))),
        layers[0]["digest"].as_str().unwrap()
    );
    assert_eq!(
        manifest["annotations"]["org.opencontainers.image.created"],
        "1970-01-01T00:00:00Z"
    );

    // The ref still names one image, for us and for skopeo.
    let inspected: Value = serde_json::from_str(&ok(oci().args([
        "inspect",
        "--json",
        &format!("oci:{}:app", layout.display()),
    ])))
    .unwrap();
    assert_eq!(inspected["digest"], image["digest"]);
    let theirs: Value = serde_json::from_str(&ok(
        Command::new("skopeo").args(["inspect", &format!("oci:{}:app", layout.display())])
    ))
    .unwrap();
    assert_eq!(theirs["Digest"], image["digest"]);
}

#[test]
fn a_failed_sbom_build_leaves_the_layout_as_it_was() {
    let tmp = tempdir();
    let root = tmp.path().join("root");
    make_tree(&root, "022", "@0");
    let layout = tmp.path().join("layout");
    build(&layout, "app", &root, &["--sbom"]);
    let before = snapshot(&layout);
    // A fifo met last in the walk, after a new file: the layer written so far is taken back.
    fs::write(root.join("new-file"), "changes the image").unwrap();
    let pipe: PathBuf = root.join("zz-pipe");
    ok(Command::new("mkfifo").arg(&pipe));
    let err = fails(
        oci()
            .args(["build", "--ref", "app", "--sbom"])
            .arg("--layout")
            .arg(&layout)
            .arg("--root")
            .arg(&root),
    );
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(err.contains("is a fifo"), "{err}");
    assert_eq!(
        snapshot(&layout),
        before,
        "the layout is byte for byte as it was"
    );
}

/// `oci verify REF --sbom` of `image`: its stdout, or its stderr when `good` is false.
fn verify_sbom(image: &str, good: bool, extra: &[&str]) -> String {
    let mut cmd = oci();
    cmd.args(["verify", image, "--sbom"]).args(extra);
    if good { ok(&mut cmd) } else { fails(&mut cmd) }
}

/// Attaches `doc` to `image` as an SBOM, as a CI step might (its own or a forged one).
fn attach_sbom(dir: &Path, image: &str, name: &str, doc: &Value) {
    let file = dir.join(name);
    fs::write(&file, serde_json::to_vec(doc).unwrap()).unwrap();
    ok(oci()
        .args(["attach", image, "--artifact-type", "application/spdx+json"])
        .args([
            "--media-type",
            "application/spdx+json",
            "--file",
            file.to_str().unwrap(),
        ]));
}

#[test]
fn verify_sbom_holds_each_sbom_against_the_layer_and_names_the_file_that_differs() {
    let tmp = tempdir();
    let root = tmp.path().join("root");
    make_tree(&root, "022", "@0");
    let files_in_tree = fs::read_dir(&root).unwrap().count();
    assert!(files_in_tree > 2, "a tree of several files");
    let layout = tmp.path().join("layout");
    let built = build(&layout, "app", &root, &["--sbom"]);
    let image = format!("oci:{}:app", layout.display());
    let good: Value = serde_json::from_slice(&sbom_of(&layout, &built)).unwrap();
    let listed = good["files"].as_array().unwrap().len();

    let said = verify_sbom(&image, true, &[]);
    assert!(
        said.starts_with(&format!(
            "SBOM {} lists the {listed} files of layer sha256:",
            built["sbom"]["digest"].as_str().unwrap()
        )),
        "{said}"
    );
    let json: Value = serde_json::from_str(&verify_sbom(&image, true, &["--json"])).unwrap();
    assert_eq!(json["sboms"][0]["files"], listed);
    assert_eq!(
        json["sboms"][0]["layer"],
        blob_json(&layout, built["manifest"]["digest"].as_str().unwrap())["layers"]
            .as_array()
            .unwrap()
            .last()
            .unwrap()["digest"]
    );

    // No SBOM at all.
    let plain_layout = tmp.path().join("plain");
    build(&plain_layout, "app", &root, &[]);
    let plain = format!("oci:{}:app", plain_layout.display());
    let said = verify_sbom(&plain, false, &[]);
    assert_eq!(
        said.trim(),
        format!(
            "oci: {plain} has no SPDX SBOM (no referrer of type application/spdx+json): build it with oci build --sbom or attach one"
        )
    );

    // Forged SBOMs, each attached beside the good one to a copy of the image: a changed sum, a
    // file left out, a file added, a mode changed, another image's SBOM.
    let first = good["files"][0]["fileName"].as_str().unwrap().to_string();
    let first_sha = good["files"][0]["checksums"][1]["checksumValue"]
        .as_str()
        .unwrap()
        .to_string();
    let mut changed = good.clone();
    changed["files"][0]["checksums"][1]["checksumValue"] = Value::String("0".repeat(64));
    let mut left_out = good.clone();
    left_out["files"].as_array_mut().unwrap().remove(0);
    let mut added = good.clone();
    let mut extra = good["files"][0].clone();
    extra["fileName"] = Value::String("./etc/backdoor".into());
    added["files"].as_array_mut().unwrap().push(extra);
    let mut mode = good.clone();
    mode["files"][0]["comment"] = Value::String(
        good["files"][0]["comment"]
            .as_str()
            .unwrap()
            .rsplit_once(' ')
            .unwrap()
            .0
            .to_string()
            + " 4755",
    );
    let other_root = tmp.path().join("other-root");
    fs::create_dir(&other_root).unwrap();
    fs::write(other_root.join("x"), "x").unwrap();
    let other_layout = tmp.path().join("other");
    let other_built = build(&other_layout, "other", &other_root, &["--sbom"]);
    let foreign: Value = serde_json::from_slice(&sbom_of(&other_layout, &other_built)).unwrap();
    let other_digest = other_built["manifest"]["digest"].as_str().unwrap();
    let cases = [
        (
            "changed",
            changed,
            format!(
                "{first} has SHA-256 {} in the SBOM but {first_sha} in the layer",
                "0".repeat(64)
            ),
        ),
        (
            "left-out",
            left_out,
            format!("{first} is in the layer but not in the SBOM"),
        ),
        (
            "added",
            added,
            "./etc/backdoor is in the SBOM but not in the layer".to_string(),
        ),
        (
            "mode",
            mode,
            format!("{first} has mode 4755 in the SBOM but"),
        ),
        (
            "foreign",
            foreign,
            format!(
                "it describes the image {other_digest}, not this one ({})",
                built["manifest"]["digest"].as_str().unwrap()
            ),
        ),
    ];
    for (name, doc, why) in cases {
        let copy = tmp.path().join(format!("copy-{name}"));
        ok(Command::new("cp").arg("-a").arg(&layout).arg(&copy));
        let target = format!("oci:{}:app", copy.display());
        attach_sbom(tmp.path(), &target, &format!("{name}.spdx.json"), &doc);
        let said = verify_sbom(&target, false, &[]);
        assert_eq!(said.lines().count(), 1, "{name}: one line: {said}");
        assert!(
            said.starts_with("oci: the SBOM sha256:")
                && said.contains(&format!(" of {target} does not match the image: {why}")),
            "{name}: {said}"
        );
        // Nothing was changed by the check: the good SBOM still holds in the original.
        verify_sbom(&image, true, &[]);
    }
}

#[test]
fn verify_sbom_reads_the_layer_from_a_registry() {
    let tmp = tempdir();
    let root = tmp.path().join("root");
    make_tree(&root, "022", "@0");
    let layout = tmp.path().join("layout");
    build(&layout, "app", &root, &["--sbom", "--compression", "zstd"]);
    let reg = testkit::registry::Registry::plain();
    let target = reg.image("team/app:v1");
    ok(oci().args([
        "copy",
        &format!("oci:{}:app", layout.display()),
        &target,
        "--plain-http",
    ]));
    let said = verify_sbom(&target, true, &["--plain-http"]);
    assert!(
        said.starts_with("SBOM sha256:") && said.contains(" files of layer sha256:"),
        "{said}"
    );
}
