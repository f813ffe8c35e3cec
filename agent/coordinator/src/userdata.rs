//! The `#cloud-config` that makes a rented machine join by itself: write the join file under
//! /run (mode 0600) and the agent's systemd unit, then one script: fetch the bundle from the
//! coordinator (curl, or wget where there is no curl), check its SHA-256 before unpacking, unpack,
//! start the unit. Any failing step fails the script: the bundle and the join file are removed,
//! the reason goes to the boot log in one line and to the coordinator, which records it on the
//! token (named only by its SHA-256) for `nodes`.
use crate::http::FAILURE_PATH;
use fleet_proto::joinfile::{DEFAULT_PATH, JoinFile};
use fleet_proto::unit::ENDED_EXIT_STATUS;

pub use fleet_proto::unit::{INSTALL_DIR, UNIT_PATH};
/// The first words of the boot log's line when the bootstrap fails.
pub const FAILED: &str = "fleet bootstrap failed:";

/// The agent's systemd unit: started after the network at every boot (after a reboot the agent
/// resumes from its membership; the join file under /run is gone by then), restarted whenever it
/// dies, and locked down as far as the agent allows. The agent stays root because its runs need
/// it; it may write only its state, its run store, the join file's folder (to remove the file),
/// cloud-init's folder (to remove the copies of the user data) and its install folder (to
/// install a release).
pub fn unit() -> String {
    format!(
        "\
[Unit]
Description=fleet agent: joins the coordinator once, then runs what it is sent
Wants=network-online.target
After=network-online.target

[Service]
Type=exec
ExecStart={INSTALL_DIR}/fleet-agent --head-less --join-file {DEFAULT_PATH}
Restart=always
RestartSec=2
# Retired or revoked by the fleet's operator: never started again.
RestartPreventExitStatus={ENDED_EXIT_STATUS}
# Runs outlive a restart of the agent, which re-adopts them; the supervisor manages their cgroups.
KillMode=process
Delegate=yes
NoNewPrivileges=yes
ProtectSystem=strict
StateDirectory=octomy-agent octomy-runs
StateDirectoryMode=0700
# The install folder too: a self-update installs its releases there and switches the link.
ReadWritePaths=-{join_dir} -/var/lib/cloud {INSTALL_DIR}
PrivateTmp=yes
ProtectHome=read-only
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectClock=yes
ProtectHostname=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
LockPersonality=yes

[Install]
WantedBy=multi-user.target
",
        join_dir = parent(DEFAULT_PATH),
    )
}

fn parent(path: &str) -> &str {
    path.rsplit_once('/').map_or("/", |(dir, _)| dir)
}

/// The bootstrap script the user data runs (also what the tests run on a simulated machine).
pub fn script(join: &JoinFile, arch: &str) -> String {
    let address = &join.address;
    let want = join.bundle_sha256.as_deref().unwrap_or_default();
    let name = format!("hub-linux-{arch}.tar.gz");
    let token_sha256 = crate::token_hash(&join.token.0);
    format!(
        r#"set -eu
dir={INSTALL_DIR}
bundle=$dir/{name}
url=http://{address}/bundles/{name}
report_url=http://{address}{FAILURE_PATH}{token_sha256}
# No wget -T: busybox-static 1.35's wget crashes on it.
have() {{ command -v "$1" >/dev/null 2>&1; }}
fetch() {{
  if have curl; then curl -fsS --connect-timeout 10 -o "$bundle" "$url"
  elif have wget; then wget -q -O "$bundle" "$url"
  else echo "neither curl nor wget is installed" >&2; return 1
  fi
}}
report() {{
  if have curl; then curl -fsS -m 10 -o /dev/null --data-binary "$1" "$report_url"
  else wget -q -O /dev/null --post-data "$1" "$report_url"
  fi
}}
fail() {{
  echo "{FAILED} $1" >&2
  rm -f "$bundle" {DEFAULT_PATH}
  report "$1" || echo "fleet bootstrap: could not tell the coordinator at {address}" >&2
  exit 1
}}
mkdir -p "$dir" || fail "cannot create $dir: check the machine's disk"
tries=0
until fetch; do
  tries=$((tries + 1))
  [ "$tries" -lt 10 ] || fail "cannot fetch $url with curl or wget after 10 tries: check that the coordinator serves there and this machine reaches it"
  sleep 2
done
got=$(sha256sum "$bundle") || fail "cannot hash $bundle with sha256sum"
got=${{got%% *}}
[ "$got" = "{want}" ] || fail "the bundle $url has SHA-256 $got, but the join file expects {want}: it was changed on the way or rebuilt since; nothing was unpacked; render new user data with fleet-coordinator user-data"
tar -xzf "$bundle" -C "$dir" || fail "cannot unpack $bundle into $dir: check the machine's disk"
rm -f "$bundle"
systemctl daemon-reload || fail "systemctl daemon-reload failed: see the boot log"
systemctl enable --now fleet-agent.service || fail "cannot start fleet-agent.service: see journalctl -u fleet-agent.service"
"#
    )
}

/// Renders the user data; `join.bundle_sha256` must be set.
pub fn render(join: &JoinFile, arch: &str) -> String {
    // Cannot fail: a join file is strings and numbers, which always serialize.
    let json = serde_json::to_string_pretty(join).expect("join files serialize");
    let mut out = String::from("#cloud-config\nwrite_files:\n");
    write_file(&mut out, DEFAULT_PATH, "0600", &json);
    write_file(&mut out, UNIT_PATH, "0644", &unit());
    out.push_str("runcmd:\n  - - sh\n    - -c\n    - |\n");
    indent(&mut out, &script(join, arch));
    out
}

fn write_file(out: &mut String, path: &str, mode: &str, content: &str) {
    out.push_str(&format!(
        "  - path: {path}\n    owner: root:root\n    permissions: '{mode}'\n    content: |\n"
    ));
    indent(out, content);
}

fn indent(out: &mut String, text: &str) {
    for line in text.lines() {
        if line.is_empty() {
            out.push('\n');
        } else {
            out.push_str(&format!("      {line}\n"));
        }
    }
}
