//! Tests: `oci build`, `oci index` and local `oci inspect`, checked against umoci and skopeo.
use std::ffi::OsStr;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::{Path, PathBuf};
use std::process::Command;
use testkit::oci::{Snap, copy_tree, snapshot, tree, workspace_root};
use testkit::{fails, ok, tempdir};

fn oci() -> Command {
    let mut c = testkit::cmd("oci");
    c.env_remove("SOURCE_DATE_EPOCH");
    c
}

/// `oci build` of `root` into `layout` as `name`, with extra flags; returns the manifest digest.
fn build(layout: &Path, name: &str, root: &Path, extra: &[&str]) -> String {
    build_with(oci(), layout, name, root, extra)
}

/// The same with another `oci` (another architecture's build under an emulator).
fn build_with(mut oci: Command, layout: &Path, name: &str, root: &Path, extra: &[&str]) -> String {
    let out = ok(oci
        .arg("build")
        .arg("--layout")
        .arg(layout)
        .args(["--ref", name])
        .arg("--root")
        .arg(root)
        .args(extra));
    out.trim().to_string()
}

fn json(cmd: &mut Command) -> serde_json::Value {
    serde_json::from_str(&ok(cmd)).expect("JSON output")
}

fn inspect(image: &str) -> serde_json::Value {
    json(oci().args(["inspect", "--json", image]))
}

fn oci_ref(layout: &Path, name: &str) -> String {
    format!("oci:{}:{name}", layout.display())
}

const NON_UTF8: &[u8] = b"caf\xe9.txt";

fn long_name() -> String {
    format!("long/{}/{}.txt", "d".repeat(120), "n".repeat(110))
}

/// One change to a tree being made.
type Step = Box<dyn Fn(&Path)>;

/// The golden tree: the committed fixture plus what git cannot keep (modes beyond +x, empty
/// directories, hardlinks), symlinks, a long name and a non-UTF-8 name. Extras are created in
/// `order` (or reversed), and every mode is then set explicitly.
fn make_tree(dir: &Path, reversed: bool, umask_077: bool) {
    let fixture = workspace_root().join("tests/fixtures/oci-golden");
    if umask_077 {
        // cp creates with the source mode less the umask: the modes on disk start out different.
        ok(Command::new("sh")
            .arg("-c")
            .arg("umask 077 && cp -r \"$0\" \"$1\"")
            .arg(&fixture)
            .arg(dir));
    } else {
        copy_tree(&fixture, dir);
    }
    let long = long_name();
    let mut steps: Vec<Step> = vec![
        Box::new(|d| fs::create_dir_all(d.join("empty")).unwrap()),
        Box::new(|d| fs::create_dir_all(d.join("var/cache/deep-empty")).unwrap()),
        Box::new(|d| symlink("run.sh", d.join("bin/run-link")).unwrap()),
        Box::new(|d| symlink("/etc/passwd", d.join("etc/passwd-link")).unwrap()),
        Box::new(|d| symlink("../../outside/the/root", d.join("a/b/escape")).unwrap()),
        Box::new(|d| {
            fs::hard_link(d.join("data/blob.bin"), d.join("data/blob-hardlink.bin")).unwrap()
        }),
        Box::new(|d| fs::hard_link(d.join("data/blob.bin"), d.join("a/third-link.bin")).unwrap()),
        Box::new(move |d| {
            let p = d.join(&long);
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            fs::write(p, "a name longer than 100 bytes\n").unwrap();
        }),
        Box::new(|d| fs::write(d.join(OsStr::from_bytes(NON_UTF8)), "not UTF-8\n").unwrap()),
        Box::new(|d| symlink(OsStr::from_bytes(NON_UTF8), d.join("link-to-non-utf8")).unwrap()),
    ];
    if reversed {
        // Hardlinks need their target first; everything else goes in reverse.
        steps.reverse();
        steps.swap(3, 4);
    }
    for step in &steps {
        step(dir);
    }
    set_modes(dir, dir);
}

fn set_modes(root: &Path, dir: &Path) {
    let special = |rel: &str| match rel {
        "bin/run.sh" => Some(0o755),
        "etc/app/app.conf" => Some(0o600),
        "a/b" => Some(0o750),
        "bin" => Some(0o2755),
        _ => None,
    };
    fs::set_permissions(
        dir,
        fs::Permissions::from_mode(special(&rel_str(root, dir)).unwrap_or(0o755)),
    )
    .unwrap();
    for e in fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let m = fs::symlink_metadata(&p).unwrap();
        if m.file_type().is_symlink() {
            continue;
        }
        if m.is_dir() {
            set_modes(root, &p);
        } else {
            fs::set_permissions(
                &p,
                fs::Permissions::from_mode(special(&rel_str(root, &p)).unwrap_or(0o644)),
            )
            .unwrap();
        }
    }
}

fn rel_str(root: &Path, p: &Path) -> String {
    p.strip_prefix(root).unwrap().to_string_lossy().into_owned()
}

/// Pinned digests of the golden tree. A change here changes every image: name it in the commit.
const GOLDEN: [(&str, &str); 3] = [
    (
        "gzip",
        "sha256:f4b2dc5d99c8d1ddc3db7eb16b9c85dfdb5845801220434eb774195617c029b3",
    ),
    (
        "zstd",
        "sha256:fea41eb43f83cea503779d0384f6f8cb6bf0bd9d3a0392162af52a6812c4a738",
    ),
    (
        "none",
        "sha256:a9d5f154fe66438983af255ab619a79c2023fa6898a6035605fb380dba00f5fa",
    ),
];

/// The golden tree built by `oci` with each compression; panics unless the pinned digests come out.
fn assert_golden_digests(oci: impl Fn() -> Command) {
    let tmp = tempdir();
    let root = tmp.path().join("root");
    make_tree(&root, false, false);
    let layout = tmp.path().join("layout");
    let got: Vec<(&str, String)> = GOLDEN
        .iter()
        .map(|(c, _)| {
            let flags = ["--compression", c, "--entrypoint", "/bin/run.sh"];
            (*c, build_with(oci(), &layout, c, &root, &flags))
        })
        .collect();
    let want: Vec<(&str, String)> = GOLDEN.iter().map(|(c, d)| (*c, d.to_string())).collect();
    assert_eq!(got, want, "digests of the golden tree");
}

#[test]
fn golden_tree_gives_the_pinned_digests() {
    assert_golden_digests(oci);
}

/// The same files give the same digest on arm64: the aarch64 musl build of `oci`, run under
/// qemu-aarch64-static, builds the golden tree to the pinned digests.
#[test]
fn the_arm64_build_gives_the_same_digests_under_qemu() {
    let binary = testkit::target_dir().join("aarch64-unknown-linux-musl/release/oci");
    assert!(
        binary.exists(),
        "{} is missing: run `cargo zigbuild --release --target aarch64-unknown-linux-musl -p oci` (cargo xtask ci does)",
        binary.display()
    );
    assert_golden_digests(|| {
        let mut c = Command::new("qemu-aarch64-static");
        c.arg(&binary).env_remove("SOURCE_DATE_EPOCH");
        c
    });
}

#[test]
fn same_files_give_one_digest_whatever_mtimes_umask_order_owners_and_threads() {
    let tmp = tempdir();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    make_tree(&a, false, false);
    make_tree(&b, true, true);
    ok(Command::new("chown")
        .args(["-R", "-h", "1234:5678"])
        .arg(&b));
    ok(Command::new("find")
        .arg(&b)
        .args(["-exec", "touch", "-h", "-d", "@1234567890", "{}", "+"]));
    assert_eq!(tree(&a), tree(&b), "the two copies hold the same files");
    let layout = tmp.path().join("layout");
    for compression in ["gzip", "zstd", "none"] {
        let one = build(
            &layout,
            "a",
            &a,
            &["--compression", compression, "--threads", "1"],
        );
        let other = build(
            &layout,
            "b",
            &b,
            &["--compression", compression, "--threads", "3"],
        );
        assert_eq!(
            one, other,
            "{compression}: both copies, 1 and 3 threads, give one digest"
        );
    }
    let first = build(&layout, "c", &a, &[]);
    let mut again = oci();
    again.env("SOURCE_DATE_EPOCH", "1700000000");
    let stamped = ok(again
        .args(["build", "--ref", "d"])
        .arg("--layout")
        .arg(&layout)
        .arg("--root")
        .arg(&a));
    assert_ne!(
        first,
        stamped.trim(),
        "SOURCE_DATE_EPOCH changes the digest"
    );
    assert_eq!(
        inspect(&oci_ref(&layout, "d"))["created"],
        "2023-11-14T22:13:20Z"
    );
}

#[test]
fn umoci_unpacks_the_input_tree() {
    let tmp = tempdir();
    let root = tmp.path().join("root");
    make_tree(&root, false, false);
    let layout = tmp.path().join("layout");
    for (name, compression, prefix) in [
        ("plain", "gzip", "/"),
        ("nested", "none", "/opt/app"),
        ("zstd", "zstd", "/srv"),
    ] {
        build(
            &layout,
            name,
            &root,
            &["--compression", compression, "--prefix", prefix],
        );
        let mut image = format!("{}:{name}", layout.display());
        if compression == "zstd" {
            // umoci 0.4 reads no zstd: skopeo's own zstd decoder turns the layer into gzip first.
            let gz = tmp.path().join("converted");
            ok(Command::new("skopeo")
                .args([
                    "copy",
                    "--quiet",
                    "--dest-compress",
                    "--dest-compress-format",
                    "gzip",
                    &format!("oci:{image}"),
                ])
                .arg(format!("oci:{}:{name}", gz.display())));
            image = format!("{}:{name}", gz.display());
        }
        let bundle = tmp.path().join(format!("bundle-{name}"));
        ok(Command::new("umoci")
            .arg("unpack")
            .arg("--image")
            .arg(&image)
            .arg(&bundle));
        let rootfs = bundle.join("rootfs").join(prefix.trim_start_matches('/'));
        assert_eq!(
            tree(&rootfs),
            tree(&root),
            "umoci's rootfs{prefix} equals the input tree"
        );
        if prefix != "/" {
            let m = fs::metadata(&rootfs).unwrap().permissions().mode() & 0o7777;
            assert_eq!(m, 0o755, "the prefix directory gets the root's mode");
        }
    }
}

#[test]
fn skopeo_inspects_and_copies_the_image() {
    let tmp = tempdir();
    let root = tmp.path().join("root");
    make_tree(&root, false, false);
    let layout = tmp.path().join("layout");
    let digest = build(
        &layout,
        "app",
        &root,
        &[
            "--compression",
            "zstd",
            "--env",
            "A=1",
            "--platform",
            "linux/arm64/v8",
        ],
    );
    let ours = inspect(&oci_ref(&layout, "app"));
    let theirs: serde_json::Value = serde_json::from_str(&ok(
        Command::new("skopeo").args(["inspect", &oci_ref(&layout, "app")])
    ))
    .unwrap();
    assert_eq!(theirs["Digest"], digest.as_str());
    assert_eq!(
        (theirs["Os"].as_str(), theirs["Architecture"].as_str()),
        (Some("linux"), Some("arm64"))
    );
    assert_eq!(theirs["Env"], serde_json::json!(["A=1"]));
    assert_eq!(theirs["Layers"][0], ours["layers"][0]["digest"]);
    let copy = tmp.path().join("copy");
    ok(Command::new("skopeo").args(["copy", &oci_ref(&layout, "app"), &oci_ref(&copy, "again")]));
    assert_eq!(
        inspect(&oci_ref(&copy, "again"))["digest"],
        digest.as_str(),
        "skopeo copy keeps the manifest"
    );
}

#[test]
fn a_base_image_is_stacked_under_the_new_layer() {
    let tmp = tempdir();
    let (base_root, app_root) = (tmp.path().join("base"), tmp.path().join("app"));
    fs::create_dir_all(base_root.join("bin")).unwrap();
    fs::write(base_root.join("bin/base"), "base\n").unwrap();
    fs::create_dir_all(app_root.join("srv")).unwrap();
    fs::write(app_root.join("srv/app"), "app\n").unwrap();
    let base_layout = tmp.path().join("base-layout");
    let env = ["--env", "PATH=/bin", "--env", "KEEP=1"];
    build(
        &base_layout,
        "base",
        &base_root,
        &[
            &env[..],
            &[
                "--entrypoint",
                "/bin/base",
                "--cmd",
                "serve",
                "--label",
                "a=1",
            ],
        ]
        .concat(),
    );
    let layout = tmp.path().join("layout");
    let base_arg = base_layout.to_str().unwrap();
    let flags = [
        "--base-layout",
        base_arg,
        "--base-ref",
        "base",
        "--env",
        "PATH=/usr/bin",
        "--env",
        "NEW=2",
        "--label",
        "b=2",
        "--workdir",
        "/srv",
    ];
    build(&layout, "app", &app_root, &flags);
    let base = inspect(&oci_ref(&base_layout, "base"));
    let app = inspect(&oci_ref(&layout, "app"));
    assert_eq!(app["layers"].as_array().unwrap().len(), 2);
    assert_eq!(app["layers"][0], base["layers"][0]);
    assert_eq!(
        app["env"],
        serde_json::json!(["PATH=/usr/bin", "KEEP=1", "NEW=2"])
    );
    assert_eq!(
        (&app["entrypoint"], &app["cmd"]),
        (
            &serde_json::json!(["/bin/base"]),
            &serde_json::json!(["serve"])
        )
    );
    assert_eq!(app["labels"], serde_json::json!({"a": "1", "b": "2"}));
    assert_eq!(app["workingDir"], "/srv");
    let bundle = tmp.path().join("bundle");
    ok(Command::new("umoci")
        .arg("unpack")
        .arg("--image")
        .arg(format!("{}:app", layout.display()))
        .arg(&bundle));
    assert_eq!(
        fs::read_to_string(bundle.join("rootfs/bin/base")).unwrap(),
        "base\n"
    );
    assert_eq!(
        fs::read_to_string(bundle.join("rootfs/srv/app")).unwrap(),
        "app\n"
    );
    // A new entrypoint drops the base's cmd; the same layout may serve as its own base.
    build(
        &base_layout,
        "child",
        &app_root,
        &[
            "--base-layout",
            base_arg,
            "--base-ref",
            "base",
            "--entrypoint",
            "/srv/app",
        ],
    );
    let child = inspect(&oci_ref(&base_layout, "child"));
    assert_eq!(
        (&child["entrypoint"], &child["cmd"]),
        (&serde_json::json!(["/srv/app"]), &serde_json::json!([]))
    );
}

#[test]
fn an_index_lists_each_platform_and_other_refs_are_left_alone() {
    let tmp = tempdir();
    let root = tmp.path().join("root");
    fs::create_dir_all(&root).unwrap();
    fs::write(root.join("hello"), "hi\n").unwrap();
    let layout = tmp.path().join("layout");
    let amd = build(&layout, "amd", &root, &["--platform", "linux/amd64"]);
    let arm = build(&layout, "arm", &root, &["--platform", "linux/arm64/v8"]);
    let index = ok(oci()
        .args([
            "index",
            "--ref",
            "multi",
            "--manifest",
            "amd",
            "--manifest",
            "arm",
        ])
        .arg("--layout")
        .arg(&layout));
    let shown = inspect(&oci_ref(&layout, "multi"));
    assert_eq!(shown["kind"], "index");
    assert_eq!(shown["digest"], index.trim());
    let platforms: Vec<(&str, &str)> = shown["manifests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["platform"].as_str().unwrap(),
                m["digest"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        platforms,
        [
            ("linux/amd64", amd.as_str()),
            ("linux/arm64/v8", arm.as_str())
        ]
    );
    let skopeo = |arch: &str| -> serde_json::Value {
        let out = ok(Command::new("skopeo").args([
            "inspect",
            "--override-arch",
            arch,
            &oci_ref(&layout, "multi"),
        ]));
        serde_json::from_str(&out).unwrap()
    };
    for arch in ["amd64", "arm64"] {
        let theirs = skopeo(arch);
        assert_eq!(
            (theirs["Digest"].as_str(), theirs["Architecture"].as_str()),
            (Some(index.trim()), Some(arch))
        );
    }
    let text = ok(oci().args(["inspect", &oci_ref(&layout, "multi")]));
    assert!(
        text.contains(&format!("  linux/arm64/v8 {arm}\n")),
        "{text}"
    );
    // Rebuilding one ref replaces it and keeps the others in their place.
    fs::write(root.join("hello"), "changed\n").unwrap();
    build(&layout, "amd", &root, &[]);
    let index_json: serde_json::Value =
        serde_json::from_slice(&fs::read(layout.join("index.json")).unwrap()).unwrap();
    let names: Vec<&str> = index_json["manifests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            m["annotations"]["org.opencontainers.image.ref.name"]
                .as_str()
                .unwrap()
        })
        .collect();
    assert_eq!(names, ["arm", "multi", "amd"]);
    let err = fails(
        oci()
            .args([
                "index",
                "--ref",
                "x",
                "--manifest",
                "amd",
                "--manifest",
                "amd",
            ])
            .arg("--layout")
            .arg(&layout),
    );
    assert_eq!(
        err,
        "oci: amd and amd are both for linux/amd64: an index holds one manifest per platform\n"
    );
}

#[test]
fn inspect_shows_the_config_by_ref_or_digest_and_raw_gives_the_stored_bytes() {
    let tmp = tempdir();
    let root = tmp.path().join("root");
    fs::create_dir_all(&root).unwrap();
    fs::write(root.join("f"), "x").unwrap();
    let layout = tmp.path().join("layout");
    let digest = build(
        &layout,
        "app",
        &root,
        &[
            "--entrypoint",
            "/f",
            "--cmd",
            "-v",
            "--env",
            "K=V",
            "--compression",
            "none",
        ],
    );
    let text = ok(oci().args(["inspect", &oci_ref(&layout, "app")]));
    let json_out = inspect(&oci_ref(&layout, "app"));
    let layer = json_out["layers"][0]["digest"].as_str().unwrap();
    let size = json_out["layers"][0]["size"].as_u64().unwrap();
    assert_eq!(
        text,
        format!(
            "digest:      {digest}\nmedia type:  application/vnd.oci.image.manifest.v1+json\nplatform:    linux/amd64\n\
             created:     1970-01-01T00:00:00Z\nentrypoint:  [\"/f\"]\ncmd:         [\"-v\"]\nenv:         [\"K=V\"]\n\
             layers:\n  {layer} application/vnd.oci.image.layer.v1.tar {size}\n"
        )
    );
    let by_digest = format!("oci:{}@{digest}", layout.display());
    assert_eq!(inspect(&by_digest), json_out);
    let raw = testkit::output(oci().args(["inspect", "--raw", &by_digest])).stdout;
    let blob = layout
        .join("blobs/sha256")
        .join(digest.trim_start_matches("sha256:"));
    assert_eq!(raw, fs::read(blob).unwrap());
    let missing = tmp.path().join("missing");
    let err = fails(oci().args(["inspect", &oci_ref(&missing, "app")]));
    assert_eq!(
        err,
        format!(
            "oci: layout {} does not exist: pass the directory of an OCI image layout\n",
            missing.display()
        )
    );
    let err = fails(oci().args(["inspect", &oci_ref(&layout, "nope")]));
    assert_eq!(
        err,
        format!(
            "oci: no image \"nope\" in {}: it has app\n",
            layout.display()
        )
    );
    let built = json(
        oci()
            .args(["build", "--json", "--ref", "j", "--compression", "none"])
            .arg("--layout")
            .arg(&layout)
            .arg("--root")
            .arg(&root),
    );
    assert_eq!(
        built["layer"]["digest"], built["diffId"],
        "an uncompressed layer is its own diff id"
    );
    assert_eq!(built["platform"], "linux/amd64");
}

/// Runs a build that must fail, and checks its one-line message and that `layout` is byte for byte as it was.
fn refused(layout: &Path, args: &[&std::ffi::OsStr], message: &str) {
    let before = snapshot(layout);
    let err = fails(oci().arg("build").arg("--layout").arg(layout).args(args));
    assert_eq!(err, format!("oci: {message}\n"));
    assert_eq!(
        snapshot(layout),
        before,
        "the layout is unchanged after: {message}"
    );
}

fn os(s: &str) -> &OsStr {
    OsStr::new(s)
}

/// `--ref new --root ROOT` and then `extra`.
fn with<'a>(root: &'a OsStr, extra: &[&'a str]) -> Vec<&'a OsStr> {
    let mut v = vec![os("--ref"), os("new"), os("--root"), root];
    v.extend(extra.iter().map(|s| os(s)));
    v
}

#[test]
fn bad_input_gets_one_line_and_leaves_the_layout_as_it_was() {
    let tmp = tempdir();
    let root = tmp.path().join("root");
    fs::create_dir_all(root.join("sub")).unwrap();
    fs::write(root.join("sub/file"), "data").unwrap();
    let layout = tmp.path().join("layout");
    build(&layout, "app", &root, &[]);
    let r = root.as_os_str();
    let t = tmp.path().display();
    let missing = tmp.path().join("nope");
    refused(
        &layout,
        &[os("--ref"), os("x"), os("--root"), missing.as_os_str()],
        &format!("root {t}/nope does not exist: pass the folder to put in the image"),
    );
    let file = root.join("sub/file");
    refused(
        &layout,
        &[os("--ref"), os("x"), os("--root"), file.as_os_str()],
        &format!("root {t}/root/sub/file is not a directory: pass the folder to put in the image"),
    );
    refused(
        &layout,
        &with(r, &["--platform", "linux/x86_64"]),
        "bad platform \"linux/x86_64\": expected OS/ARCH[/VARIANT] with a known OS and architecture, such as linux/amd64 or linux/arm64/v8",
    );
    refused(
        &layout,
        &[os("--ref"), os("bad ref"), os("--root"), r],
        "bad ref \"bad ref\": use letters and digits, separated by one of . _ - : @ + or /",
    );
    refused(
        &layout,
        &with(r, &["--prefix", "app"]),
        "bad prefix \"app\": it must be an absolute path such as /app",
    );
    refused(
        &layout,
        &with(r, &["--prefix", "/a/../b"]),
        "bad prefix \"/a/../b\": it must not hold . or .. components",
    );
    refused(
        &layout,
        &with(r, &["--env", "NOEQUALS"]),
        "bad env \"NOEQUALS\": expected KEY=VALUE with a non-empty KEY",
    );
    refused(
        &layout,
        &with(r, &["--compression", "xz"]),
        "bad compression \"xz\": use gzip, zstd or none",
    );
    let layout_arg = layout.display().to_string();
    refused(
        &layout,
        &with(r, &["--base-layout", &layout_arg, "--base-ref", "missing"]),
        &format!("no image \"missing\" in {layout_arg}: it has app"),
    );

    refused(
        &layout,
        &with(r, &["--base-layout", "x"]),
        "the following required arguments were not provided: --base-ref <REF>; see oci --help",
    );

    let not_layout = tmp.path().join("not-a-layout");
    fs::create_dir_all(&not_layout).unwrap();
    fs::write(not_layout.join("notes.txt"), "mine").unwrap();
    refused(
        &not_layout,
        &with(r, &[]),
        &format!(
            "{t}/not-a-layout is not an OCI image layout (no oci-layout file): pass a layout, or a new or empty directory"
        ),
    );
    let not_layout_arg = not_layout.display().to_string();
    refused(
        &layout,
        &with(r, &["--base-layout", &not_layout_arg, "--base-ref", "app"]),
        &format!(
            "{t}/not-a-layout is not an OCI image layout (no oci-layout file): pass a layout, or a new or empty directory"
        ),
    );

    // A new layout that fails is not left behind, not even as an empty folder.
    let fresh = tmp.path().join("fresh");
    refused(
        &fresh,
        &with(r, &["--platform", "linux"]),
        "bad platform \"linux\": expected OS/ARCH[/VARIANT] with a known OS and architecture, such as linux/amd64 or linux/arm64/v8",
    );
    assert!(!fresh.exists());

    // Special files are refused by path, after the layer was half written: it is taken back.
    let with_socket = tmp.path().join("with-socket");
    fs::create_dir_all(&with_socket).unwrap();
    fs::write(with_socket.join("a-file"), "x".repeat(100_000)).unwrap();
    let _listener = std::os::unix::net::UnixListener::bind(with_socket.join("sock")).unwrap();
    let sock_msg = format!(
        "{t}/with-socket/sock is a socket: a layer holds only files, directories and symlinks; remove it from the root"
    );
    refused(
        &layout,
        &[os("--ref"), os("s"), os("--root"), with_socket.as_os_str()],
        &sock_msg,
    );
    refused(
        &fresh,
        &[os("--ref"), os("s"), os("--root"), with_socket.as_os_str()],
        &sock_msg,
    );
    assert!(!fresh.exists());
    let empty = tmp.path().join("empty-dir");
    fs::create_dir_all(&empty).unwrap();
    refused(
        &empty,
        &[os("--ref"), os("s"), os("--root"), with_socket.as_os_str()],
        &sock_msg,
    );
    assert_eq!(snapshot(&empty).len(), 0, "an empty directory stays empty");
}

#[test]
fn a_base_blob_whose_bytes_do_not_match_is_refused_by_name() {
    let tmp = tempdir();
    let root = tmp.path().join("root");
    fs::create_dir_all(&root).unwrap();
    fs::write(root.join("f"), "base").unwrap();
    let base = tmp.path().join("base");
    build(&base, "base", &root, &[]);
    let layer = inspect(&oci_ref(&base, "base"))["layers"][0]["digest"]
        .as_str()
        .unwrap()
        .to_string();
    let blob = base
        .join("blobs/sha256")
        .join(layer.trim_start_matches("sha256:"));
    let mut bytes = fs::read(&blob).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    fs::write(&blob, &bytes).unwrap();
    let actual = format!("sha256:{}", sha256_hex(&bytes));
    let layout = tmp.path().join("layout");
    build(&layout, "other", &root, &["--compression", "zstd"]);
    let base_arg = base.as_os_str();
    let message = format!(
        "blob {layer} does not match its digest: its {} bytes hash to {actual} (in {})",
        bytes.len(),
        base.display()
    );
    let args = [
        os("--ref"),
        os("app"),
        os("--root"),
        root.as_os_str(),
        os("--base-layout"),
        base_arg,
        os("--base-ref"),
        os("base"),
    ];
    refused(&layout, &args, &message);
    refused(&base, &args, &message);
}

fn sha256_hex(bytes: &[u8]) -> String {
    let mut child = Command::new("sha256sum")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child.stdin.take().unwrap().write_all(bytes).unwrap();
    let out = child.wait_with_output().unwrap();
    String::from_utf8(out.stdout)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

#[test]
fn no_temporary_files_are_left_in_the_layout() {
    let tmp = tempdir();
    let root: PathBuf = workspace_root().join("examples/sample-app");
    let layout = tmp.path().join("layout");
    build(&layout, "sample", &root, &["--entrypoint", "/bin/hello"]);
    let leftovers: Vec<_> = snapshot(&layout)
        .into_iter()
        .filter(|(p, s)| p.to_string_lossy().contains(".tmp") || matches!(s, Snap::Link(_)))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    assert_eq!(
        fs::read_to_string(layout.join("oci-layout")).unwrap(),
        r#"{"imageLayoutVersion":"1.0.0"}"#
    );
}

#[test]
fn layout_files_are_readable_by_other_users_not_0600() {
    let tmp = tempdir();
    let root = tmp.path().join("root");
    fs::create_dir_all(&root).unwrap();
    fs::write(root.join("f"), "x").unwrap();
    let layout = tmp.path().join("layout");
    // Under umask 022 every file a layout holds is 0644, as umoci and skopeo write them.
    ok(Command::new("sh")
        .arg("-c")
        .arg("umask 022 && exec \"$0\" \"$@\"")
        .arg(testkit::bin("oci"))
        .arg("build")
        .arg("--layout")
        .arg(&layout)
        .args(["--ref", "app", "--root"])
        .arg(&root));
    let modes: Vec<(PathBuf, u32)> = snapshot(&layout)
        .keys()
        .map(|rel| layout.join(rel))
        .filter(|p| p.is_file())
        .map(|p| {
            let mode = fs::metadata(&p).unwrap().permissions().mode() & 0o7777;
            (p, mode)
        })
        .collect();
    assert!(modes.len() >= 5, "{modes:?}");
    for (path, mode) in modes {
        assert_eq!(mode, 0o644, "{}", path.display());
    }
}

#[test]
fn a_file_over_8_gib_comes_back_whole_through_gnu_tar() {
    let tmp = tempdir();
    let root = tmp.path().join("root");
    fs::create_dir_all(&root).unwrap();
    // Sparse, so it takes no disk, yet every one of its bytes streams through the build.
    let size: u64 = 8600 * 1024 * 1024;
    fs::File::create(root.join("huge"))
        .unwrap()
        .set_len(size)
        .unwrap();
    fs::write(root.join("tail.txt"), "after the big one\n").unwrap();
    let layout = tmp.path().join("layout");
    let manifest = build(&layout, "big", &root, &["--compression", "gzip"]);
    let blob = |digest: &str| layout.join("blobs/sha256").join(&digest["sha256:".len()..]);
    let manifest: serde_json::Value =
        serde_json::from_slice(&fs::read(blob(&manifest)).unwrap()).unwrap();
    let config: serde_json::Value = serde_json::from_slice(
        &fs::read(blob(manifest["config"]["digest"].as_str().unwrap())).unwrap(),
    )
    .unwrap();
    let layer = blob(manifest["layers"][0]["digest"].as_str().unwrap());
    // One pass: gzip and sha256sum recompute the diff id, GNU tar lists the entries after the big one.
    let sum = tmp.path().join("diff-id");
    let listing = ok(Command::new("bash")
        .arg("-c")
        .arg("set -o pipefail; gzip -dc \"$0\" | tee >(sha256sum > \"$1\") | tar -tvf -")
        .arg(&layer)
        .arg(&sum));
    let huge = listing
        .lines()
        .find(|l| l.ends_with(" huge"))
        .unwrap_or_else(|| panic!("no huge in {listing}"));
    assert!(huge.contains(&format!(" {size} ")), "{huge}");
    assert!(
        listing.lines().any(|l| l.ends_with(" tail.txt")),
        "{listing}"
    );
    // tee's sha256sum may finish just after tar; wait for its line.
    let mut diff_id = String::new();
    let summed = testkit::agent::wait_until(std::time::Duration::from_secs(120), || {
        diff_id = fs::read_to_string(&sum).unwrap_or_default();
        diff_id.len() >= 64
    });
    assert!(summed, "sha256sum never wrote the diff id: {diff_id:?}");
    assert_eq!(
        format!("sha256:{}", &diff_id[..64]),
        config["rootfs"]["diff_ids"][0].as_str().unwrap()
    );
}

/// A small root with one file whose contents are `text`.
fn small_root(dir: &Path, text: &str) -> PathBuf {
    fs::create_dir_all(dir.join("etc")).unwrap();
    fs::write(dir.join("etc/app.conf"), text).unwrap();
    dir.to_path_buf()
}

/// Temporary files (`.tmp-*`) anywhere in a layout.
fn temporaries(layout: &Path) -> Vec<PathBuf> {
    snapshot(layout)
        .into_keys()
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with(".tmp-"))
        })
        .collect()
}

/// The ref names of a layout's index.json, in order.
fn ref_names(layout: &Path) -> Vec<String> {
    let index: serde_json::Value =
        serde_json::from_slice(&fs::read(layout.join("index.json")).unwrap()).unwrap();
    index["manifests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            m["annotations"]["org.opencontainers.image.ref.name"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect()
}

#[test]
fn a_layout_inside_its_root_is_left_out_and_three_builds_give_one_digest() {
    let tmp = tempdir();
    let root = small_root(&tmp.path().join("app"), "port=80\n");
    // The same files built from outside: what every build from inside must equal.
    let outside = build(&tmp.path().join("outside"), "app", &root, &[]);
    let digests: Vec<String> = (1..=3)
        .map(|i| {
            let out = ok(oci()
                .current_dir(&root)
                .args(["build", "--layout", "out", "--root", "."])
                .args(["--ref", &format!("app{i}")]));
            out.trim().to_string()
        })
        .collect();
    assert_eq!(digests, [outside.clone(), outside.clone(), outside.clone()]);
    assert_eq!(ref_names(&root.join("out")), ["app1", "app2", "app3"]);
    // Also when the layout is deeper in the root and named by an absolute path (its parent
    // folder is the root's own, and stays in the layer).
    let other = small_root(&tmp.path().join("other"), "port=81\n");
    fs::create_dir_all(other.join("build")).unwrap();
    let outside = build(&tmp.path().join("outside"), "other", &other, &[]);
    let deep = other.join("build/oci");
    assert_eq!(build(&deep, "a", &other, &[]), outside);
    assert_eq!(build(&deep, "b", &other, &[]), outside);
    // A root inside the layout would hold the blob being written: refused, nothing changes.
    let blobs = root.join("out/blobs");
    refused(
        &root.join("out"),
        &[os("--ref"), os("x"), os("--root"), blobs.as_os_str()],
        &format!(
            "root {} is inside the layout {}: pass a root outside the layout",
            blobs.display(),
            root.join("out").display()
        ),
    );
}

/// Starts `oci ARGS` without waiting.
fn spawn(args: &[&OsStr]) -> std::process::Child {
    oci()
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits for a started command that must succeed; returns its stdout trimmed.
fn landed(child: std::process::Child) -> String {
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// 8 builds, 2 copies and (into an existing layout) an index, all started at once into `layout`;
/// every ref is set once to what its command printed, and umoci and skopeo read each one.
fn concurrent_writers_all_land(tmp: &Path, layout: &Path, existing: bool) {
    let source = tmp.join("source");
    let source_digest = build(&source, "src", &small_root(&tmp.join("src"), "src\n"), &[]);
    let mut expected: Vec<(String, String)> = Vec::new();
    if existing {
        expected.push((
            "amd".into(),
            build(layout, "amd", &source.join("../src"), &[]),
        ));
        expected.push((
            "arm".into(),
            build(
                layout,
                "arm",
                &source.join("../src"),
                &["--platform", "linux/arm64/v8"],
            ),
        ));
    }
    let roots: Vec<PathBuf> = (0..8)
        .map(|i| small_root(&tmp.join(format!("root{i}")), &format!("build {i}\n")))
        .collect();
    let l = layout.as_os_str();
    let mut started: Vec<(String, std::process::Child)> = Vec::new();
    for (i, root) in roots.iter().enumerate() {
        let name = format!("b{i}");
        let args = [
            os("build"),
            os("--layout"),
            l,
            os("--ref"),
            os(&name),
            os("--root"),
            root.as_os_str(),
            os("--threads"),
            os("1"),
        ];
        started.push((name.clone(), spawn(&args)));
    }
    for i in 0..2 {
        let name = format!("c{i}");
        let (from, to) = (oci_ref(&source, "src"), oci_ref(layout, &name));
        started.push((name, spawn(&[os("copy"), os(&from), os(&to)])));
    }
    if existing {
        let args = [
            os("index"),
            os("--layout"),
            l,
            os("--ref"),
            os("multi"),
            os("--manifest"),
            os("amd"),
            os("arm"),
        ];
        started.push(("multi".into(), spawn(&args)));
    }
    // Builds that fail at the same time (a socket in the root) take back only what they added,
    // even when one of them made the layout.
    let bad = tmp.join("bad");
    fs::create_dir_all(&bad).unwrap();
    let _socket = std::os::unix::net::UnixListener::bind(bad.join("sock")).unwrap();
    let failing: Vec<std::process::Child> = (0..3)
        .map(|i| {
            let name = format!("bad{i}");
            let args = [
                os("build"),
                os("--layout"),
                l,
                os("--ref"),
                os(&name),
                os("--root"),
                bad.as_os_str(),
            ];
            spawn(&args)
        })
        .collect();
    for (name, child) in started {
        expected.push((name, landed(child)));
    }
    for child in failing {
        let out = child.wait_with_output().unwrap();
        assert_eq!(
            String::from_utf8_lossy(&out.stderr),
            format!(
                "oci: {} is a socket: a layer holds only files, directories and symlinks; remove it from the root\n",
                bad.join("sock").display()
            )
        );
    }
    for (name, digest) in &expected {
        if name.starts_with('c') {
            assert_eq!(digest, &source_digest, "{name}");
        }
    }
    let mut names = ref_names(layout);
    names.sort();
    let mut want: Vec<String> = expected.iter().map(|(n, _)| n.clone()).collect();
    want.sort();
    assert_eq!(names, want, "every ref is set exactly once");
    assert!(temporaries(layout).is_empty());
    let mut listed: Vec<String> = ok(Command::new("umoci").args(["ls", "--layout"]).arg(layout))
        .lines()
        .map(str::to_string)
        .collect();
    listed.sort();
    assert_eq!(listed, want, "umoci lists every ref");
    for (name, digest) in &expected {
        let theirs: serde_json::Value = serde_json::from_str(&ok(Command::new("skopeo").args([
            "inspect",
            "--raw",
            &oci_ref(layout, name),
        ])))
        .unwrap();
        assert!(theirs.is_object(), "{name}");
        assert_eq!(
            inspect(&oci_ref(layout, name))["digest"],
            digest.as_str(),
            "{name}"
        );
    }
}

#[test]
fn concurrent_builds_copies_and_indexes_into_a_new_layout_all_land() {
    let tmp = tempdir();
    concurrent_writers_all_land(tmp.path(), &tmp.path().join("new/layout"), false);
}

#[test]
fn concurrent_builds_copies_and_indexes_into_an_existing_layout_all_land() {
    let tmp = tempdir();
    concurrent_writers_all_land(tmp.path(), &tmp.path().join("layout"), true);
}

/// Starts a build of a 1 GiB (sparse) file into `layout`, waits for its temporary blob to appear,
/// sends `signal` and returns how the build ended.
fn interrupted_build(root: &Path, layout: &Path, signal: &str) -> std::process::ExitStatus {
    let mut child = oci()
        .args(["build", "--ref", "big", "--threads", "1", "--layout"])
        .arg(layout)
        .arg("--root")
        .arg(root)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !fs::read_dir(layout.join("blobs/sha256")).is_ok_and(|mut d| {
        d.any(|e| {
            e.unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with(".tmp-")
        })
    }) {
        assert!(child.try_wait().unwrap().is_none(), "the build ended first");
        assert!(std::time::Instant::now() < deadline, "no temporary blob");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    ok(Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(child.id().to_string()));
    child.wait().unwrap()
}

#[test]
fn sigint_sigterm_and_sigkill_leave_no_temporary_file_after_the_next_command() {
    use std::os::unix::process::ExitStatusExt;
    let tmp = tempdir();
    let big = tmp.path().join("big");
    fs::create_dir_all(&big).unwrap();
    fs::File::create(big.join("zeros"))
        .unwrap()
        .set_len(1 << 30)
        .unwrap();
    let small = small_root(&tmp.path().join("small"), "x\n");
    let layout = tmp.path().join("layout");
    build(&layout, "base", &small, &[]);
    let before = snapshot(&layout);
    for (signal, number) in [("INT", 2), ("TERM", 15)] {
        let status = interrupted_build(&big, &layout, signal);
        assert_eq!(status.signal(), Some(number), "{signal} ends the build");
        assert_eq!(
            snapshot(&layout),
            before,
            "{signal}: the layout is as it was"
        );
        // A layout the build made is taken back whole.
        let fresh = tmp.path().join(format!("fresh-{signal}"));
        interrupted_build(&big, &fresh, signal);
        assert!(!fresh.exists(), "{signal}: the new layout is removed");
    }
    let status = interrupted_build(&big, &layout, "KILL");
    assert_eq!(status.signal(), Some(9));
    assert_eq!(temporaries(&layout).len(), 1, "SIGKILL cannot be caught");
    // The next writer of the layout removes what the killed one left, whatever it writes.
    build(&layout, "next", &small, &[]);
    assert_eq!(temporaries(&layout), Vec::<PathBuf>::new());
    assert_eq!(ref_names(&layout), ["base", "next"]);
    let fresh = tmp.path().join("fresh-KILL");
    interrupted_build(&big, &fresh, "KILL");
    assert_eq!(temporaries(&fresh).len(), 1);
    ok(oci().args([
        "copy",
        &oci_ref(&layout, "base"),
        &oci_ref(&fresh, "copied"),
    ]));
    assert_eq!(temporaries(&fresh), Vec::<PathBuf>::new());
    ok(Command::new("umoci").args(["ls", "--layout"]).arg(&fresh));
}

#[test]
fn a_ref_named_twice_is_refused_by_every_command_naming_both_digests() {
    let tmp = tempdir();
    let layout = tmp.path().join("layout");
    let first = build(
        &layout,
        "app",
        &small_root(&tmp.path().join("a"), "a\n"),
        &[],
    );
    let second = build(
        &layout,
        "other",
        &small_root(&tmp.path().join("b"), "b\n"),
        &[],
    );
    // Another tool (or a hand edit) wrote the name twice.
    let path = layout.join("index.json");
    let text = fs::read_to_string(&path).unwrap();
    fs::write(&path, text.replace("\"other\"", "\"app\"")).unwrap();
    let message = format!(
        "oci: ref \"app\" is ambiguous in {}: it names {first} and {second}; pick one by its digest instead of the name\n",
        layout.display()
    );
    let image = oci_ref(&layout, "app");
    let l = layout.display().to_string();
    let root = tmp.path().join("a").display().to_string();
    let commands: [Vec<&str>; 5] = [
        vec!["inspect", &image],
        vec!["push", &image, "docker://127.0.0.1:1/app:1", "--plain-http"],
        vec!["copy", &image, "oci:/nonexistent-never-made:x"],
        vec!["index", "--layout", &l, "--ref", "i", "--manifest", "app"],
        vec![
            "build",
            "--layout",
            &l,
            "--ref",
            "n",
            "--root",
            &root,
            "--base-layout",
            &l,
            "--base-ref",
            "app",
        ],
    ];
    let before = snapshot(&layout);
    for args in commands {
        assert_eq!(fails(oci().args(&args)), message, "{args:?}");
    }
    assert_eq!(snapshot(&layout), before);
    assert!(!Path::new("/nonexistent-never-made").exists());
    // By digest, each image is there.
    let by_digest = format!("oci:{}@{second}", layout.display());
    assert_eq!(inspect(&by_digest)["digest"], second.as_str());
    // umoci refuses it too.
    let umoci = fails(
        Command::new("umoci")
            .arg("stat")
            .arg("--image")
            .arg(format!("{}:app", layout.display())),
    );
    assert!(umoci.contains("tag is ambiguous"), "{umoci}");
    // Rebuilding the ref leaves it named once.
    build(
        &layout,
        "app",
        &small_root(&tmp.path().join("a"), "a\n"),
        &[],
    );
    assert_eq!(ref_names(&layout), ["app"]);
}

#[test]
fn index_takes_several_manifests_after_one_flag_as_the_docs_say() {
    let tmp = tempdir();
    let layout = tmp.path().join("layout");
    let root = small_root(&tmp.path().join("r"), "r\n");
    build(&layout, "amd", &root, &[]);
    build(&layout, "arm", &root, &["--platform", "linux/arm64/v8"]);
    let index = |args: &[&str]| {
        ok(oci().args(["index", "--layout"]).arg(&layout).args(args))
            .trim()
            .to_string()
    };
    let one_flag = index(&["--ref", "a", "--manifest", "amd", "arm"]);
    let two_flags = index(&[
        "--ref",
        "b",
        "--manifest",
        "amd",
        "--manifest",
        "arm",
        "--json",
    ]);
    let two_flags: serde_json::Value = serde_json::from_str(&two_flags).unwrap();
    assert_eq!(two_flags["index"]["digest"], one_flag.as_str());
}

#[test]
fn a_pseudo_file_and_an_unreadable_file_each_say_what_to_do() {
    let tmp = tempdir();
    let layout = tmp.path().join("layout");
    // /proc files claim size 0 and yet have contents: not a file that changed while read.
    let err = fails(
        oci()
            .args([
                "build",
                "--ref",
                "p",
                "--root",
                "/proc/sys/fs/mqueue",
                "--layout",
            ])
            .arg(&layout),
    );
    assert_eq!(
        err,
        "oci: /proc/sys/fs/mqueue/msg_default is a pseudo-file (its size reads as 0 but it has contents, as under /proc or /sys): copy what it holds into a regular file in the root\n"
    );
    assert!(!layout.exists());
    // A file this user cannot read (as root, the build runs as nobody).
    let root = small_root(&tmp.path().join("root"), "x\n");
    let secret = root.join("etc/secret");
    fs::write(&secret, "s").unwrap();
    fs::set_permissions(&secret, fs::Permissions::from_mode(0o000)).unwrap();
    fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o777)).unwrap();
    let is_root = ok(Command::new("id").arg("-u")).trim() == "0";
    let mut cmd = if is_root {
        let mut c = Command::new("setpriv");
        c.args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(testkit::bin("oci"));
        c
    } else {
        oci()
    };
    let err = fails(
        cmd.args(["build", "--ref", "s", "--root"])
            .arg(&root)
            .arg("--layout")
            .arg(&layout),
    );
    assert_eq!(
        err,
        format!(
            "oci: cannot read {}: Permission denied (os error 13): give the user running oci access to it, or run oci as a user that has it\n",
            secret.display()
        )
    );
    assert!(!layout.exists());
}
