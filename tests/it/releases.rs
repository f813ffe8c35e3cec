//! Signed releases made and checked with `fleet-coordinator release`, with `openssl` and
//! `sha256sum` as independent oracles: the key files are PKCS#8 Ed25519 that openssl reads, the
//! manifest's signature verifies under openssl over the signed context, and the digests are the
//! binaries' own. Each bad release is refused with its one line.
use base64::Engine;
use serde_json::Value;
use std::path::Path;
use std::process::Command;
use testkit::release::{ReleaseKeys, bundle};

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

fn release(args: &[&str]) -> Command {
    let mut cmd = testkit::cmd("fleet-coordinator");
    cmd.arg("release").args(args);
    cmd
}

fn s(path: &Path) -> &str {
    path.to_str().unwrap()
}

fn sha256sum(bytes: &[u8], dir: &Path) -> String {
    let path = dir.join("hashed");
    std::fs::write(&path, bytes).unwrap();
    let out = testkit::ok(Command::new("sha256sum").arg(&path));
    format!("sha256:{}", out.split_whitespace().next().unwrap())
}

/// openssl's own check of an Ed25519 signature over `message`, with the raw public key `key`.
fn openssl_verifies(dir: &Path, key: &str, message: &[u8], signature: &str) -> bool {
    let raw = B64.decode(key.strip_prefix("ed25519:").unwrap()).unwrap();
    // SubjectPublicKeyInfo for Ed25519: the fixed prefix, then the 32 bytes.
    let mut der = hex_bytes("302a300506032b6570032100");
    der.extend_from_slice(&raw);
    std::fs::write(dir.join("pub.der"), der).unwrap();
    std::fs::write(dir.join("msg"), message).unwrap();
    std::fs::write(dir.join("sig"), B64.decode(signature).unwrap()).unwrap();
    Command::new("openssl")
        .args(["pkeyutl", "-verify", "-pubin", "-keyform", "DER", "-rawin"])
        .arg("-inkey")
        .arg(dir.join("pub.der"))
        .arg("-in")
        .arg(dir.join("msg"))
        .arg("-sigfile")
        .arg(dir.join("sig"))
        .output()
        .unwrap()
        .status
        .success()
}

fn hex_bytes(hex: &str) -> Vec<u8> {
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect()
}

fn last_line(err: &str) -> &str {
    err.lines().last().unwrap_or_default()
}

#[test]
fn a_release_signed_under_a_root_verifies_and_each_bad_one_is_refused_naming_why() {
    let tmp = testkit::tempdir();
    let dir = tmp.path();
    let root_file = dir.join("root.key");
    let root = testkit::ok(&mut release(&["keygen", "--out", s(&root_file)]))
        .trim()
        .to_string();
    assert!(root.starts_with("ed25519:"), "{root}");
    // The key file is PKCS#8 that openssl reads, with the public key keygen printed.
    let spki = Command::new("openssl")
        .args(["pkey", "-pubout", "-outform", "DER", "-in"])
        .arg(&root_file)
        .output()
        .unwrap();
    assert!(
        spki.status.success(),
        "{}",
        String::from_utf8_lossy(&spki.stderr)
    );
    assert_eq!(format!("ed25519:{}", B64.encode(&spki.stdout[12..])), root);
    let refused = testkit::fails(&mut release(&["keygen", "--out", s(&root_file)]));
    assert!(
        last_line(&refused).contains("exists: a key is never overwritten"),
        "{refused}"
    );
    let key_file = dir.join("release.key");
    let key = testkit::ok(&mut release(&["keygen", "--out", s(&key_file)]))
        .trim()
        .to_string();
    let cert = dir.join("release.key.cert");
    testkit::ok(&mut release(&[
        "certify",
        "--root",
        s(&root_file),
        "--key",
        &key,
        "--name",
        "release-2026",
        "--out",
        s(&cert),
    ]));

    let dist = dir.join("dist");
    std::fs::create_dir_all(&dist).unwrap();
    let agent_x86: &[u8] = b"\x7fELF agent for x86_64";
    bundle(
        &dist,
        "x86_64",
        &[
            ("fleet-agent", agent_x86),
            ("fleet-run-supervisor", b"supervisor x86_64"),
        ],
    );
    // One bundle missing: refused, naming it and what makes it.
    let sign = |expires: &str| {
        let mut cmd = release(&[
            "sign",
            "--key",
            s(&key_file),
            "--cert",
            s(&cert),
            "--dir",
            s(&dist),
            "--version",
            "0.2.0",
            "--sequence",
            "7",
            "--min-sequence",
            "5",
            "--expires-in",
            expires,
        ]);
        cmd.stderr(std::process::Stdio::piped());
        cmd
    };
    let refused = testkit::fails(&mut sign("30d"));
    assert!(
        last_line(&refused).contains("hub-linux-arm64.tar.gz"),
        "{refused}"
    );
    assert!(
        last_line(&refused).contains("cargo xtask dist"),
        "{refused}"
    );
    assert!(!dist.join("release.json").exists(), "nothing written");
    bundle(
        &dist,
        "arm64",
        &[
            ("fleet-agent", b"agent for arm64"),
            ("fleet-run-supervisor", b"supervisor arm64"),
        ],
    );
    testkit::ok(&mut sign("30d"));

    let verify = |root: &str| {
        let mut cmd = release(&["verify", "--dir", s(&dist), "--root", root]);
        cmd.stderr(std::process::Stdio::piped());
        cmd
    };
    let manifest: Value = serde_json::from_str(&testkit::ok(&mut verify(&root))).unwrap();
    assert_eq!(manifest["sequence"], 7);
    assert_eq!(manifest["min_sequence"], 5);
    assert_eq!(
        manifest["binaries"].as_array().unwrap().len(),
        4,
        "{manifest:#}"
    );
    let agent = (manifest["binaries"].as_array().unwrap().iter())
        .find(|b| b["name"] == "fleet-agent" && b["target"] == "x86_64-unknown-linux-musl")
        .unwrap();
    assert_eq!(agent["sha256"], sha256sum(agent_x86, dir));
    assert_eq!(agent["size"], agent_x86.len());
    // openssl agrees: the release key signed the manifest's bytes under their context, and the
    // root signed the certificate that names the release key.
    let bytes = std::fs::read(dist.join("release.json")).unwrap();
    let sig: Value =
        serde_json::from_slice(&std::fs::read(dist.join("release.sig")).unwrap()).unwrap();
    let signed = [b"fleet release manifest v1\n".as_slice(), &bytes].concat();
    assert!(openssl_verifies(
        dir,
        &key,
        &signed,
        sig["signature"].as_str().unwrap()
    ));
    let certificate = B64.decode(sig["certificate"].as_str().unwrap()).unwrap();
    let certified = [
        b"fleet release key certificate v1\n".as_slice(),
        &certificate,
    ]
    .concat();
    assert!(openssl_verifies(
        dir,
        &root,
        &certified,
        sig["certificate_signature"].as_str().unwrap()
    ));
    assert!(!openssl_verifies(
        dir,
        &root,
        &signed,
        sig["signature"].as_str().unwrap()
    ));

    // Under another fleet's root.
    let other = testkit::ok(&mut release(&[
        "keygen",
        "--out",
        s(&dir.join("other.key")),
    ]))
    .trim()
    .to_string();
    let refused = testkit::fails(&mut verify(&other));
    assert_eq!(
        last_line(&refused),
        format!(
            "fleet-coordinator: the release key is certified by {root}, which is not a root of this fleet (it trusts {other})"
        )
    );
    // A binary that is not the one signed for.
    std::fs::copy(
        dist.join("hub-linux-x86_64.tar.gz"),
        dir.join("kept.tar.gz"),
    )
    .unwrap();
    bundle(
        &dist,
        "x86_64",
        &[
            ("fleet-agent", b"\x7fELF another agent"),
            ("fleet-run-supervisor", b"supervisor x86_64"),
        ],
    );
    let refused = testkit::fails(&mut verify(&root));
    assert!(
        last_line(&refused).contains(
            "fleet-agent for x86_64-unknown-linux-musl does not match the manifest: it is sha256:"
        ),
        "{refused}"
    );
    std::fs::copy(
        dir.join("kept.tar.gz"),
        dist.join("hub-linux-x86_64.tar.gz"),
    )
    .unwrap();
    testkit::ok(&mut verify(&root));
    // A manifest changed after it was signed.
    let changed = String::from_utf8(bytes.clone())
        .unwrap()
        .replace("\"sequence\": 7", "\"sequence\": 8");
    std::fs::write(dist.join("release.json"), changed).unwrap();
    let refused = testkit::fails(&mut verify(&root));
    assert_eq!(
        last_line(&refused),
        format!(
            "fleet-coordinator: the manifest's signature does not verify under the release key {key}"
        )
    );
    // Past its expiry.
    testkit::ok(&mut sign("1ms"));
    std::thread::sleep(std::time::Duration::from_millis(20));
    let refused = testkit::fails(&mut verify(&root));
    assert!(
        last_line(&refused).contains("the manifest expired at "),
        "{refused}"
    );
    assert!(last_line(&refused).ends_with("sign it again"), "{refused}");
    // A key that is not the certified one: refused before anything is written.
    let before = std::fs::read(dist.join("release.json")).unwrap();
    let stranger = dir.join("stranger.key");
    testkit::ok(&mut release(&["keygen", "--out", s(&stranger)]));
    let refused = testkit::fails(&mut release(&[
        "sign",
        "--key",
        s(&stranger),
        "--cert",
        s(&cert),
        "--dir",
        s(&dist),
        "--sequence",
        "9",
    ]));
    assert!(
        last_line(&refused).contains("does not go with the certificate"),
        "{refused}"
    );
    assert_eq!(
        std::fs::read(dist.join("release.json")).unwrap(),
        before,
        "nothing written"
    );
}

#[test]
fn a_serving_coordinator_takes_a_release_in_once_its_root_is_trusted_and_only_upward() {
    let tmp = testkit::tempdir();
    let dir = tmp.path();
    let coord = testkit::agent::Coordinator::start(&dir.join("coord"), &[]);
    let keys = ReleaseKeys::new(&dir.join("keys"));
    let files = |agent: &'static [u8]| {
        [
            ("fleet-agent", agent),
            ("fleet-run-supervisor", b"supervisor".as_slice()),
        ]
    };
    let (root, dist) = (keys.root.clone(), keys.release(7, &files(b"agent seven")));
    let add = |dist: &Path| {
        let mut cmd = coord.command();
        cmd.args(["release", "add"]).arg(dist);
        cmd
    };
    let refused = testkit::fails(&mut add(&dist));
    assert_eq!(
        last_line(&refused),
        "fleet-coordinator: this fleet trusts no release root yet: run `fleet-coordinator release trust --root ed25519:...` with the root's public key first"
    );
    let trusted = testkit::ok(coord.command().args(["release", "trust", "--root", &root]));
    assert_eq!(trusted.trim(), root);
    assert_eq!(
        testkit::ok(&mut add(&dist)).trim(),
        "took in release 0.1.0 (sequence 7, 4 binaries)"
    );
    assert_eq!(
        testkit::ok(&mut add(&dist)).trim(),
        "already had release 0.1.0 (sequence 7, 4 binaries)"
    );
    // The binaries are content of the coordinator, by digest.
    let agent = sha256sum(b"agent seven", dir);
    let blob = dir
        .join("coord/blobs/sha256")
        .join(agent.strip_prefix("sha256:").unwrap());
    assert_eq!(std::fs::read(&blob).unwrap(), b"agent seven");
    // A release at or below one taken in is refused, and nothing is recorded.
    let older = keys.release(6, &files(b"agent six"));
    let refused = testkit::fails(&mut add(&older));
    assert!(
        last_line(&refused).ends_with("the release's sequence 6 is not above 7, the sequence of release 0.1.0 taken in before: sign it with a higher --sequence"),
        "{refused}"
    );
    let listed: Value = serde_json::from_str(&testkit::ok(
        coord.command().args(["release", "list", "--json"]),
    ))
    .unwrap();
    let sequences: Vec<u64> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["sequence"].as_u64().unwrap())
        .collect();
    assert_eq!(sequences, [7]);
    let newer = keys.release(9, &files(b"agent nine"));
    testkit::ok(&mut add(&newer));
    let text = testkit::ok(coord.command().args(["release", "list"]));
    assert_eq!(text.lines().count(), 3, "{text}");
    assert!(text.lines().nth(2).unwrap().starts_with("9 "), "{text}");
}

#[test]
fn a_release_signed_under_the_old_root_rotates_the_fleets_roots_and_a_revoked_key_is_refused() {
    let tmp = testkit::tempdir();
    let dir = tmp.path();
    let coord = testkit::agent::Coordinator::start(&dir.join("coord"), &[]);
    let (old, new) = (
        ReleaseKeys::new(&dir.join("old")),
        ReleaseKeys::new(&dir.join("new")),
    );
    let files = |agent: &'static [u8]| {
        [
            ("fleet-agent", agent),
            ("fleet-run-supervisor", b"supervisor".as_slice()),
        ]
    };
    let add = |dist: &Path| {
        let mut cmd = coord.command();
        cmd.args(["release", "add"]).arg(dist);
        cmd
    };
    testkit::ok(
        coord
            .command()
            .args(["release", "trust", "--root", &old.root]),
    );
    let join: Value = serde_json::from_str(&coord.token(&[])).unwrap();
    assert_eq!(join["release_roots"], serde_json::json!([old.root]));
    // Release 7, signed under the old root, names the new root.
    let rotating = old.release_with(7, &files(b"agent seven"), &["--rotate-root", &new.root]);
    let manifest: Value =
        serde_json::from_slice(&std::fs::read(rotating.join("release.json")).unwrap()).unwrap();
    assert_eq!(manifest["roots"], serde_json::json!([new.root]));
    testkit::ok(&mut add(&rotating));
    // From here on the fleet trusts the new root only: the join file says so, and a release the
    // old root certified is refused while the new root's is taken in.
    let join: Value = serde_json::from_str(&coord.token(&[])).unwrap();
    assert_eq!(join["release_roots"], serde_json::json!([new.root]));
    let under_old = old.release(8, &files(b"agent eight"));
    let refused = testkit::fails(&mut add(&under_old));
    assert!(
        last_line(&refused).contains(&format!(
            "the release key is certified by {}, which is not a root of this fleet (it trusts {})",
            old.root, new.root
        )),
        "{refused}"
    );
    let under_new = new.release(8, &files(b"agent eight"));
    testkit::ok(&mut add(&under_new));
    testkit::ok(coord.command().args(["rollout", "start", "--release", "8"]));
    // The new release key is revoked by hand: the rollout of its release 8 halts saying why, the
    // release can no longer be sent or rolled out, and its next release is refused.
    let revoked = testkit::ok(
        coord
            .command()
            .args(["release", "revoke", "--key", &new.key]),
    );
    assert_eq!(revoked.trim(), format!("revoked {}", new.key));
    let why = format!(
        "release 8 can no longer be sent: the release key {} is revoked: sign the release with a key the fleet's root certified since",
        new.key
    );
    // `--watch` follows it until it halts, a line each time it changes, then says why and fails.
    let watched = coord.watch_rollout(60);
    assert_eq!(watched.status.code(), Some(1), "{watched:?}");
    let lines = String::from_utf8_lossy(&watched.stdout);
    assert!(
        lines.lines().all(|l| l.starts_with("release 8: ")),
        "{lines}"
    );
    assert_eq!(
        last_line(&String::from_utf8_lossy(&watched.stderr)),
        format!("fleet-coordinator: the rollout of release 8 halted: {why}")
    );
    testkit::ok(coord.command().args(["rollout", "abort"]));
    let line = coord.refusal(&["rollout", "start", "--release", "8"]);
    assert_eq!(
        line,
        format!(
            "fleet-coordinator: release 8 can no longer be sent: the release key {} is revoked: sign the release with a key the fleet's root certified since",
            new.key
        )
    );
    let next = new.release(9, &files(b"agent nine"));
    let refused = testkit::fails(&mut add(&next));
    assert!(
        last_line(&refused).ends_with(&format!(
            "the release key {} is revoked: sign the release with a key the fleet's root certified since",
            new.key
        )),
        "{refused}"
    );
}
