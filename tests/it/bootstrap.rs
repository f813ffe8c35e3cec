//! The bootstrap as a rented machine plays it: the rendered user data checked by cloud-init's own
//! schema and its unit by `systemd-analyze verify`; then a simulated fresh machine (a network
//! namespace joined to the host by a veth pair, a root folder holding busybox-static, a tmpfs on
//! its /run) runs the bootstrap script taken from the user data, fetches the bundle from a
//! coordinator listening on the host's side of the veth, and joins; a reboot resumes; a tampered
//! bundle is refused, removed and reported.
//!
//! The machine has no systemd: `systemctl` there is a stand-in that starts the unit's own
//! `ExecStart` line (read from the unit the user data wrote). The bundle holds this build's debug
//! binaries (stripped), which link glibc: the glibc libraries they need are copied into the root,
//! as plain Debian has them. Needs root, `ip` (iproute2), busybox-static, Debian's python3 with
//! cloud-init's dependencies and cloud-init unpacked under target/cloud-init (`cargo xtask ci`
//! installs all of them).
use serde_json::Value;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};
use testkit::agent::{Coordinator, wait_until};
use testkit::netns::Net;

const WAIT: Duration = Duration::from_secs(30);
const JOIN_FILE: &str = "run/octomy/fleet.json";
const AGENT_LOG: &str = "var/log/fleet-agent.log";

/// Runs a command that must succeed, naming it when it does not.
fn sh(cmd: &mut Command) -> String {
    testkit::ok(cmd)
}

#[derive(Clone, Copy, PartialEq)]
enum Fetcher {
    /// busybox's wget applet, and no curl.
    Wget,
    /// The host's curl with its libraries, and no wget.
    Curl,
}

/// The busybox applets a plain machine has (wget only where chosen).
const APPLETS: &[&str] = &[
    "sh",
    "mkdir",
    "rm",
    "sleep",
    "sha256sum",
    "tar",
    "gzip",
    "cat",
    "sed",
    "setsid",
    "ls",
    "echo",
    "env",
    "test",
    "[",
    "mv",
    "cp",
    "true",
];

/// A fresh machine: a root folder with busybox, its network namespace, a tmpfs on /run and proc
/// on /proc. Dropped: every process of it killed, its mounts removed, its folder deleted.
struct Machine {
    root: PathBuf,
    net: Net,
    _dir: tempfile::TempDir,
}

impl Machine {
    fn new(index: u8, fetcher: Fetcher) -> Machine {
        let dir = testkit::tempdir();
        let root = dir.path().canonicalize().unwrap().join("root");
        for d in [
            "bin",
            "etc/systemd/system",
            "var/lib/cloud/instances/iid-1/scripts",
            "var/log",
            "run",
            "proc",
            "dev",
            "tmp",
            "root",
        ] {
            std::fs::create_dir_all(root.join(d)).unwrap();
        }
        std::os::unix::fs::symlink("instances/iid-1", root.join("var/lib/cloud/instance")).unwrap();
        std::fs::copy("/usr/bin/busybox", root.join("bin/busybox")).unwrap();
        let mut applets = APPLETS.to_vec();
        match fetcher {
            Fetcher::Wget => applets.push("wget"),
            Fetcher::Curl => {
                std::fs::copy("/usr/bin/curl", root.join("bin/curl")).unwrap();
                copy_libs(&root, Path::new("/usr/bin/curl"));
            }
        }
        for applet in applets {
            std::os::unix::fs::symlink("busybox", root.join("bin").join(applet)).unwrap();
        }
        for bin in ["fleet-agent", "fleet-run-supervisor"] {
            copy_libs(&root, &testkit::bin(bin));
        }
        for (name, minor) in [("null", 3), ("zero", 5), ("urandom", 9)] {
            sh(Command::new("mknod")
                .arg(root.join("dev").join(name))
                .args(["c", "1", &minor.to_string()]));
            std::fs::set_permissions(
                root.join("dev").join(name),
                std::fs::Permissions::from_mode(0o666),
            )
            .unwrap();
        }
        testkit::agent::script(
            &root.join("bin/systemctl"),
            "# A stand-in for systemd, which this root lacks: starts the unit's own ExecStart line.\n\
             case \"$*\" in\n\
             daemon-reload) exit 0 ;;\n\
             'enable --now fleet-agent.service'|'start fleet-agent.service')\n\
               cmd=$(sed -n 's/^ExecStart=//p' /etc/systemd/system/fleet-agent.service)\n\
               [ -n \"$cmd\" ] || { echo 'systemctl: no ExecStart' >&2; exit 1; }\n\
               setsid sh -c \"exec $cmd\" </dev/null >>/var/log/fleet-agent.log 2>&1 &\n\
               ;;\n\
             *) echo \"systemctl stand-in: $* is not supported\" >&2; exit 1 ;;\n\
             esac",
        );
        let net = Net::new("fb", index);
        let machine = Machine {
            root,
            net,
            _dir: dir,
        };
        machine.mount_run();
        sh(Command::new("mount")
            .args(["-t", "proc", "proc"])
            .arg(machine.root.join("proc")));
        machine
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.root.join(rel)
    }

    fn mount_run(&self) {
        sh(Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=16m,mode=0755", "tmpfs"])
            .arg(self.path("run")));
    }

    /// Plays cloud-init: the user data's files written, its copies kept where cloud-init keeps
    /// them; returns the bootstrap script (its one `runcmd`).
    fn receive(&self, user_data: &str) -> String {
        let doc = yaml(user_data);
        for file in doc["write_files"].as_array().unwrap() {
            let path = self.path(file["path"].as_str().unwrap().trim_start_matches('/'));
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, file["content"].as_str().unwrap()).unwrap();
            let mode = u32::from_str_radix(file["permissions"].as_str().unwrap(), 8).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        }
        let script = doc["runcmd"][0][2].as_str().unwrap().to_string();
        let instance = self.path("var/lib/cloud/instances/iid-1");
        std::fs::write(instance.join("user-data.txt"), user_data).unwrap();
        std::fs::write(instance.join("user-data.txt.i"), user_data).unwrap();
        std::fs::write(instance.join("cloud-config.txt"), user_data).unwrap();
        std::fs::write(instance.join("scripts/runcmd"), &script).unwrap();
        let user_data_file = self.path("tmp/user-data");
        std::fs::write(&user_data_file, user_data).unwrap();
        self.cloud_init_cache(&[
            "store",
            self.root.to_str().unwrap(),
            user_data_file.to_str().unwrap(),
        ]);
        std::fs::remove_file(user_data_file).unwrap();
        script
    }

    /// cloud-init's datasource cache, by Debian's cloud-init itself
    /// (tests/fixtures/cloud_init_cache.py): `store` on the first boot, `boot` at every boot after.
    fn cloud_init_cache(&self, args: &[&str]) {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/cloud_init_cache.py");
        let out = testkit::output(
            Command::new("/usr/bin/python3")
                .args(["-W", "ignore"])
                .arg(script)
                .args(args)
                .env("PYTHONPATH", cloud_init()),
        );
        assert!(
            out.status.success(),
            "cloud-init's cache {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Runs a shell command inside the machine: its namespace, its root, a plain environment.
    fn exec(&self, command: &str) -> Output {
        testkit::output(
            Command::new("ip")
                .args(["netns", "exec", &self.net.ns, "chroot"])
                .arg(&self.root)
                .args(["/bin/sh", "-c", command])
                .env_clear()
                .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
                .stdin(Stdio::null()),
        )
    }

    fn agent_log(&self) -> String {
        std::fs::read_to_string(self.path(AGENT_LOG)).unwrap_or_default()
    }

    /// The ids of every process whose root is this machine's.
    fn processes(&self) -> Vec<u32> {
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .filter(|pid| {
                std::fs::read_link(format!("/proc/{pid}/root")).is_ok_and(|r| r == self.root)
            })
            .collect()
    }

    /// A power cut: every process of the machine killed, its /run emptied.
    fn power_off(&self) {
        let gone = wait_until(WAIT, || {
            let pids = self.processes();
            for pid in &pids {
                let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            }
            pids.is_empty()
        });
        assert!(gone, "the machine's processes would not die");
        let _ = Command::new("umount").arg(self.path("run")).status();
    }

    /// Every file on the machine's disk and its /run (not /proc), following no links.
    fn files(&self) -> Vec<PathBuf> {
        let mut out = Vec::new();
        let mut stack = vec![self.root.clone()];
        while let Some(dir) = stack.pop() {
            for entry in std::fs::read_dir(&dir).unwrap().flatten() {
                let path = entry.path();
                let kind = entry.file_type().unwrap();
                if kind.is_dir() && path != self.path("proc") {
                    stack.push(path);
                } else if kind.is_file() {
                    out.push(path);
                }
            }
        }
        out
    }
}

impl Drop for Machine {
    fn drop(&mut self) {
        self.power_off();
        let _ = Command::new("umount").arg(self.path("proc")).status();
    }
}

/// Copies the shared libraries a host binary loads into the root, at the same paths.
fn copy_libs(root: &Path, binary: &Path) {
    let ldd = sh(Command::new("ldd").arg(binary));
    for lib in ldd
        .lines()
        .filter_map(|l| l.split_whitespace().find(|w| w.starts_with('/')))
    {
        let dest = root.join(lib.trim_start_matches('/'));
        if !dest.exists() {
            std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
            std::fs::copy(lib, &dest).unwrap();
        }
    }
}

/// The YAML as JSON, read by an independent parser (PyYAML, the one cloud-init uses).
fn yaml(text: &str) -> Value {
    let dir = testkit::tempdir();
    let file = dir.path().join("user-data");
    std::fs::write(&file, text).unwrap();
    let json = sh(Command::new("/usr/bin/python3")
        .args([
            "-c",
            "import sys, yaml, json; print(json.dumps(yaml.safe_load(open(sys.argv[1]))))",
        ])
        .arg(&file));
    serde_json::from_str(&json).unwrap()
}

/// `hub-linux-x86_64.tar.gz` in the layout `cargo xtask dist` packs, from this build's binaries
/// (stripped), made once per test run.
fn bundle() -> &'static Path {
    static BUNDLE: OnceLock<PathBuf> = OnceLock::new();
    BUNDLE.get_or_init(|| {
        let dir = testkit::target_dir().join("bootstrap-bundle");
        let staging = dir.join(format!("staging-{}", std::process::id()));
        std::fs::create_dir_all(&staging).unwrap();
        for bin in ["fleet-agent", "fleet-run-supervisor"] {
            sh(Command::new("strip")
                .arg("-o")
                .arg(staging.join(bin))
                .arg(testkit::bin(bin)));
        }
        let bundle = dir.join("hub-linux-x86_64.tar.gz");
        let packed = staging.with_extension("tar.gz");
        sh(Command::new("sh").arg("-c").arg(format!(
            "tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C {} -cf - . | gzip -1 -n > {}",
            staging.display(),
            packed.display()
        )));
        std::fs::rename(&packed, &bundle).unwrap();
        std::fs::remove_dir_all(&staging).unwrap();
        bundle
    })
}

/// A coordinator serving on the host's side of the machine's veth, with the bundle in place.
fn coordinator(dir: &Path, machine: &Machine) -> Coordinator {
    let data = dir.join("coord");
    std::fs::create_dir_all(data.join("bundles")).unwrap();
    std::fs::copy(bundle(), data.join("bundles/hub-linux-x86_64.tar.gz")).unwrap();
    Coordinator::start_on(&data, &format!("{}:0", machine.net.host_ip), &[])
}

fn user_data(coord: &Coordinator, arch: &str) -> String {
    sh(coord
        .command()
        .args(["user-data", "--arch", arch, "--name", "m1", "--ttl", "5m"]))
}

fn token_of(user_data: &str) -> String {
    let join: Value = serde_json::from_str(
        yaml(user_data)["write_files"][0]["content"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    join["token"].as_str().unwrap().to_string()
}

/// Runs a program on every node and returns what it wrote to greeting.txt, collected.
fn run_and_collect(coord: &Coordinator, dir: &Path, word: &str) -> String {
    let program = testkit::agent::script(
        &dir.join(format!("{word}.sh")),
        "echo \"ran $1\" > greeting.txt",
    );
    let set = sh(coord
        .command()
        .args(["run", "--all", "--timeout", "20s", "--program"])
        .arg(&program)
        .args(["--", word]));
    let rows = sh(coord
        .command()
        .args(["status", "--set", set.trim(), "--poll", "--json"]));
    let row = serde_json::from_str::<Value>(&rows).unwrap()[0].clone();
    assert_eq!(row["state"], "finished", "{row:#}");
    let out = dir.join(format!("{word}.out"));
    sh(coord
        .command()
        .args(["collect", "--run", row["run_id"].as_str().unwrap()])
        .args(["--path", "greeting.txt", "--out"])
        .arg(&out));
    std::fs::read_to_string(out).unwrap()
}

/// The bootstrap on a fresh machine, up to the agent's `Joined`; returns how long that took.
fn bootstrap(machine: &Machine, script: &str) -> Duration {
    let started = Instant::now();
    let out = machine.exec(script);
    assert!(
        out.status.success(),
        "the bootstrap failed: {}\nagent log: {}",
        String::from_utf8_lossy(&out.stderr),
        machine.agent_log()
    );
    assert!(
        wait_until(WAIT, || machine.agent_log().contains("Joined")),
        "no join; agent log: {}",
        machine.agent_log()
    );
    started.elapsed()
}

fn assert_no_secret_left(machine: &Machine, token: &str) {
    let instance = machine.path("var/lib/cloud/instances/iid-1");
    for copy in [
        "user-data.txt",
        "user-data.txt.i",
        "cloud-config.txt",
        "scripts",
    ] {
        assert!(!instance.join(copy).exists(), "{copy} is still there");
    }
    assert!(!machine.path(JOIN_FILE).exists(), "the join file remains");
    for file in machine.files() {
        let bytes = std::fs::read(&file).unwrap();
        assert!(
            !bytes.windows(token.len()).any(|w| w == token.as_bytes()),
            "the token is still in {}",
            file.display()
        );
    }
}

fn fresh_machine_joins_runs_and_resumes(index: u8, fetcher: Fetcher) {
    let machine = Machine::new(index, fetcher);
    let dir = testkit::tempdir();
    let coord = coordinator(dir.path(), &machine);
    let text = user_data(&coord, "x86_64");
    let token = token_of(&text);
    let script = machine.receive(&text);
    assert!(script.contains(&format!("http://{}:", machine.net.host_ip)));

    let took = bootstrap(&machine, &script);
    eprintln!(
        "bootstrap start -> Joined: {} ms ({})",
        took.as_millis(),
        if fetcher == Fetcher::Wget {
            "wget"
        } else {
            "curl"
        }
    );
    assert!(
        !machine.path("opt/octomy/hub-linux-x86_64.tar.gz").exists(),
        "the bundle is removed once unpacked"
    );
    assert_eq!(run_and_collect(&coord, dir.path(), "first"), "ran first\n");
    assert_no_secret_left(&machine, &token);

    // A reboot: nothing of the machine survives but its disk; cloud-init restores its cache and
    // writes the user data's copies from it again (it still loads: the token was blanked in
    // place); the unit starts the agent again.
    machine.power_off();
    machine.mount_run();
    machine.cloud_init_cache(&["boot", machine.root.to_str().unwrap()]);
    let restored =
        std::fs::read_to_string(machine.path("var/lib/cloud/instances/iid-1/user-data.txt"))
            .unwrap();
    assert!(restored.starts_with("#cloud-config"), "{restored}");
    assert!(!restored.contains(&token), "the cache still held the token");
    let out = machine.exec("systemctl start fleet-agent.service");
    assert!(out.status.success(), "{out:?}");
    assert!(
        wait_until(WAIT, || machine.agent_log().matches("session open").count()
            >= 2),
        "no new session after the reboot: {}",
        machine.agent_log()
    );
    let log = machine.agent_log();
    assert_eq!(log.matches("joining").count(), 1, "one join only: {log}");
    assert!(
        log.contains("resuming the membership; no join needed"),
        "{log}"
    );
    assert_eq!(
        run_and_collect(&coord, dir.path(), "second"),
        "ran second\n"
    );
    assert_no_secret_left(&machine, &token);
    let nodes = coord.nodes();
    assert_eq!(nodes.len(), 1, "{nodes:#?}");
    assert_eq!(nodes[0]["state"], "Joined");
}

#[test]
fn a_fresh_machine_with_only_wget_bootstraps_runs_and_resumes_after_a_reboot() {
    fresh_machine_joins_runs_and_resumes(1, Fetcher::Wget);
}

#[test]
fn a_fresh_machine_with_only_curl_bootstraps_runs_and_resumes_after_a_reboot() {
    fresh_machine_joins_runs_and_resumes(2, Fetcher::Curl);
}

#[test]
fn a_tampered_bundle_is_refused_before_unpacking_removed_and_reported() {
    let machine = Machine::new(3, Fetcher::Wget);
    let dir = testkit::tempdir();
    let coord = coordinator(dir.path(), &machine);
    let text = user_data(&coord, "x86_64");
    let script = machine.receive(&text);
    // One byte changed on the coordinator's side after the user data was rendered.
    let served = coord.data.join("bundles/hub-linux-x86_64.tar.gz");
    let mut bytes = std::fs::read(&served).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x01;
    std::fs::write(&served, &bytes).unwrap();
    let want = testkit::ok(Command::new("sha256sum").arg(bundle()));
    let got = testkit::ok(Command::new("sha256sum").arg(&served));
    let (want, got) = (
        want.split_whitespace().next().unwrap(),
        got.split_whitespace().next().unwrap(),
    );

    let out = machine.exec(&script);
    assert!(!out.status.success(), "the script must fail");
    let url = format!("http://{}/bundles/hub-linux-x86_64.tar.gz", coord.addr);
    let reason = format!(
        "the bundle {url} has SHA-256 {got}, but the join file expects {want}: it was changed on the way or rebuilt since; nothing was unpacked; render new user data with fleet-coordinator user-data"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        stderr.lines().collect::<Vec<_>>(),
        [format!("fleet bootstrap failed: {reason}")],
        "one line in the boot log"
    );
    let installed: Vec<_> = std::fs::read_dir(machine.path("opt/octomy"))
        .unwrap()
        .collect();
    assert!(
        installed.is_empty(),
        "nothing unpacked, bundle removed: {installed:?}"
    );
    assert!(
        !machine.path(JOIN_FILE).exists(),
        "the join file is removed"
    );
    assert!(machine.processes().is_empty(), "nothing runs");
    assert!(!machine.path(AGENT_LOG).exists(), "the agent never started");

    let nodes = coord.nodes();
    assert_eq!(nodes.len(), 1, "{nodes:#?}");
    assert_eq!(nodes[0]["state"], "failed");
    assert_eq!(nodes[0]["name"], "m1");
    assert_eq!(
        nodes[0]["error"].as_str(),
        Some(format!("bootstrap failed: {reason}").as_str())
    );
    let token = token_of(&text);
    assert!(
        !nodes[0].to_string().contains(&token),
        "the token is named only by its hash"
    );
    let table = sh(coord.command().arg("nodes"));
    let row = table.lines().nth(1).unwrap();
    assert!(row.starts_with("token-"), "{table}");
    assert!(row.contains(" failed "), "{table}");
    assert!(
        row.ends_with(&format!("bootstrap failed: {reason}")),
        "{table}"
    );
    assert!(
        coord.log_text().contains("a machine's bootstrap failed"),
        "{}",
        coord.log_text()
    );
}

/// Where `cargo xtask ci` unpacks Debian's cloud-init package (`dpkg -x`; installing it would
/// set up its boot services).
fn cloud_init() -> PathBuf {
    let dir = testkit::target_dir().join("cloud-init/usr/lib/python3/dist-packages");
    assert!(
        dir.join("cloudinit/config/schema.py").exists(),
        "cloud-init is not unpacked under {}: run `cargo xtask ci`, or `apt-get download cloud-init` and `dpkg -x` it into target/cloud-init",
        dir.display()
    );
    dir
}

/// `cloud-init schema --config-file`, run from the unpacked package with Debian's python3.
fn schema_check(dir: &Path, text: &str) -> Output {
    let file = dir.join("user-data.yaml");
    std::fs::write(&file, text).unwrap();
    testkit::output(
        Command::new("/usr/bin/python3")
            .args([
                "-W",
                "ignore",
                "-m",
                "cloudinit.config.schema",
                "--config-file",
            ])
            .arg(&file)
            .env("PYTHONPATH", cloud_init()),
    )
}

#[test]
fn user_data_is_valid_for_cloud_init_on_both_architectures_and_its_unit_verifies() {
    let dir = testkit::tempdir();
    let data = dir.path().join("coord");
    std::fs::create_dir_all(data.join("bundles")).unwrap();
    let coord = Coordinator::start(&data, &[]);
    for arch in ["x86_64", "arm64"] {
        std::fs::write(
            data.join(format!("bundles/hub-linux-{arch}.tar.gz")),
            arch.as_bytes(),
        )
        .unwrap();
        let text = user_data(&coord, arch);
        let out = schema_check(dir.path(), &text);
        assert!(
            out.status.success()
                && String::from_utf8_lossy(&out.stdout).contains("Valid cloud-config"),
            "{arch}: {out:?}"
        );
        assert!(text.contains(&format!("/bundles/hub-linux-{arch}.tar.gz")));
    }
    // The oracle can fail: a mode written as a number is not valid for cloud-init.
    let text = user_data(&coord, "x86_64").replace("permissions: '0600'", "permissions: 0600");
    let out = schema_check(dir.path(), &text);
    assert!(!out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("is not of type 'string'"),
        "{out:?}"
    );

    // The unit, as the user data writes it, passes systemd's own check, with its ExecStart
    // binary in place (a tmpfs over /opt in a private mount namespace, so the host is untouched).
    let doc = yaml(&user_data(&coord, "x86_64"));
    let unit = &doc["write_files"][1];
    assert_eq!(unit["path"], "/etc/systemd/system/fleet-agent.service");
    let content = unit["content"].as_str().unwrap();
    for line in [
        "Restart=always",
        "WantedBy=multi-user.target",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "PrivateTmp=yes",
    ] {
        assert!(content.lines().any(|l| l == line), "{line} in {content}");
    }
    let unit_file = dir.path().join("fleet-agent.service");
    std::fs::write(&unit_file, content).unwrap();
    let verify = |unit_file: &Path| {
        testkit::output(
            Command::new("unshare")
                .args(["--mount", "sh", "-c"])
                .arg(format!(
                    "mount -t tmpfs tmpfs /opt && mkdir /opt/octomy && cp {} /opt/octomy/fleet-agent && systemd-analyze verify {}",
                    testkit::bin("fleet-agent").display(),
                    unit_file.display()
                )),
        )
    };
    let out = verify(&unit_file);
    assert!(
        out.status.success() && out.stderr.is_empty(),
        "systemd-analyze verify: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The check can fail: a misspelt key is reported.
    let broken = dir.path().join("broken.service");
    std::fs::write(&broken, content.replace("Restart=always", "Restrat=always")).unwrap();
    let out = verify(&broken);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("Unknown key 'Restrat'"),
        "{out:?}"
    );
}

#[test]
fn an_architecture_without_a_bundle_is_refused_when_the_user_data_is_rendered() {
    let dir = testkit::tempdir();
    let data = dir.path().join("coord");
    std::fs::create_dir_all(data.join("bundles")).unwrap();
    let coord = Coordinator::start(&data, &[]);
    let bundle = data.join("bundles/hub-linux-arm64.tar.gz");
    assert_eq!(
        coord.refusal(&["user-data", "--arch", "arm64"]),
        format!(
            "fleet-coordinator: cannot read the bundle {}: No such file or directory (os error 2): build it with `cargo xtask dist`",
            bundle.display()
        )
    );
    let nodes = coord.nodes();
    assert!(nodes.is_empty(), "no token minted: {nodes:?}");
}
