//! The `#cloud-config` that makes a rented machine join by itself: write the join file under
//! /run (mode 0600), fetch the bundle from the coordinator, check its SHA-256, unpack, start.
use fleet_proto::joinfile::{DEFAULT_PATH, JoinFile};

/// Where the bundle is unpacked on the machine.
pub const INSTALL_DIR: &str = "/opt/octomy";

/// Renders the user data; `join.bundle_sha256` must be set.
pub fn render(join: &JoinFile, arch: &str) -> String {
    let json = serde_json::to_string_pretty(join).expect("join files serialize");
    let sha = join.bundle_sha256.as_deref().unwrap_or_default();
    let url = format!("http://{}/bundles/hub-linux-{arch}.tar.gz", join.address);
    let mut out = String::from("#cloud-config\nwrite_files:\n");
    out.push_str(&format!(
        "  - path: {DEFAULT_PATH}\n    owner: root:root\n    permissions: '0600'\n    content: |\n"
    ));
    for line in json.lines() {
        out.push_str(&format!("      {line}\n"));
    }
    let script = [
        "set -eu".to_string(),
        format!("mkdir -p {INSTALL_DIR}"),
        format!("curl -fsS --retry 10 --retry-connrefused -o {INSTALL_DIR}/hub.tar.gz {url}"),
        format!("echo '{sha}  {INSTALL_DIR}/hub.tar.gz' | sha256sum -c -"),
        format!("tar -xzf {INSTALL_DIR}/hub.tar.gz -C {INSTALL_DIR}"),
        format!("rm -f {INSTALL_DIR}/hub.tar.gz"),
        format!(
            "nohup {INSTALL_DIR}/fleet-agent --head-less --join-file {DEFAULT_PATH} >>/var/log/fleet-agent.log 2>&1 &"
        ),
    ];
    out.push_str("runcmd:\n  - - sh\n    - -c\n    - |\n");
    for line in script {
        out.push_str(&format!("      {line}\n"));
    }
    out
}
