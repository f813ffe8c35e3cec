//! Release keys and signed release folders, made with `fleet-coordinator release` as an operator
//! makes them, and bundles packed by the system's tar and gzip as `cargo xtask dist` packs them.
use std::path::{Path, PathBuf};
use std::process::Command;

fn release(args: &[&str]) -> Command {
    let mut cmd = crate::cmd("fleet-coordinator");
    cmd.arg("release").args(args);
    cmd
}

fn s(path: &Path) -> &str {
    path.to_str().expect("a UTF-8 path")
}

/// A bundle `hub-linux-ARCH.tar.gz` in `dir` holding `files`.
pub fn bundle(dir: &Path, arch: &str, files: &[(&str, &[u8])]) {
    let staging = dir.join(format!("staging-{arch}"));
    std::fs::create_dir_all(&staging).unwrap();
    for (name, bytes) in files {
        std::fs::write(staging.join(name), bytes).unwrap();
    }
    let out = dir.join(format!("hub-linux-{arch}.tar.gz"));
    let script = format!("tar -C {} -cf - . | gzip -n > {}", s(&staging), s(&out));
    let packed = Command::new("sh").arg("-c").arg(script).status().unwrap();
    assert!(packed.success(), "packing {}", out.display());
    std::fs::remove_dir_all(&staging).unwrap();
}

/// A fleet root and a release key it certified, in `dir`.
pub struct ReleaseKeys {
    dir: PathBuf,
    /// The root's public key, `ed25519:...`.
    pub root: String,
    /// The release key's public key.
    pub key: String,
}

impl ReleaseKeys {
    pub fn new(dir: &Path) -> ReleaseKeys {
        std::fs::create_dir_all(dir).unwrap();
        let root_file = dir.join("root.key");
        let root = crate::ok(&mut release(&["keygen", "--out", s(&root_file)]));
        let key_file = dir.join("release.key");
        let key = crate::ok(&mut release(&["keygen", "--out", s(&key_file)]));
        crate::ok(&mut release(&[
            "certify",
            "--root",
            s(&root_file),
            "--key",
            key.trim(),
            "--out",
            s(&dir.join("release.key.cert")),
        ]));
        ReleaseKeys {
            dir: dir.to_path_buf(),
            root: root.trim().to_string(),
            key: key.trim().to_string(),
        }
    }

    pub fn root_file(&self) -> PathBuf {
        self.dir.join("root.key")
    }

    pub fn key_file(&self) -> PathBuf {
        self.dir.join("release.key")
    }

    pub fn cert_file(&self) -> PathBuf {
        self.dir.join("release.key.cert")
    }

    /// A signed release of `sequence` in `dir/release-SEQUENCE`: its x86_64 bundle holds `files`,
    /// its arm64 bundle stand-ins of the same names.
    pub fn release(&self, sequence: u64, files: &[(&str, &[u8])]) -> PathBuf {
        self.release_with(sequence, files, &[])
    }

    /// [`ReleaseKeys::release`] signed with the `release sign` flags `sign` besides
    /// (`--rotate-root`, `--revoke`).
    pub fn release_with(&self, sequence: u64, files: &[(&str, &[u8])], sign: &[&str]) -> PathBuf {
        let dist = self.dir.join(format!("release-{sequence}"));
        std::fs::create_dir_all(&dist).unwrap();
        bundle(&dist, "x86_64", files);
        let stand_ins: Vec<(&str, &[u8])> = files
            .iter()
            .map(|(n, _)| (*n, b"arm64".as_slice()))
            .collect();
        bundle(&dist, "arm64", &stand_ins);
        crate::ok(
            release(&[
                "sign",
                "--key",
                s(&self.key_file()),
                "--cert",
                s(&self.cert_file()),
                "--dir",
                s(&dist),
                "--sequence",
                &sequence.to_string(),
            ])
            .args(sign),
        );
        dist
    }
}
