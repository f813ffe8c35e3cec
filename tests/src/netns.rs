//! A machine's network: a namespace joined to the host by a veth pair, with private addresses
//! that exist only inside the pair, and a hosts file of its own (what `ip netns exec` puts over
//! `/etc/hosts` inside). Everything is removed when dropped.
use std::process::{Command, Stdio};

pub struct Net {
    pub ns: String,
    pub host_if: String,
    /// The host's side of the pair, which the namespace reaches directly.
    pub host_ip: String,
    subnet: String,
}

fn sh(cmd: &mut Command) {
    crate::ok(cmd);
}

impl Net {
    /// The pair numbered `index` of this test process; `tag` (two letters) names its interfaces.
    pub fn new(tag: &str, index: u8) -> Net {
        let pid = std::process::id();
        // A /30 of 10/8 of this process's own, so concurrent test runs never share one.
        let subnet = format!("10.{}.{}", 100 + pid % 100, (pid / 100) % 250);
        let net = Net {
            ns: format!("fleet-{tag}-{pid}-{index}"),
            host_if: format!("{tag}{}h{index}", pid % 100_000),
            host_ip: format!("{subnet}.{}", index * 4 + 1),
            subnet,
        };
        let machine_if = format!("{tag}{}m{index}", pid % 100_000);
        let machine_ip = format!("{}.{}/30", net.subnet, index * 4 + 2);
        sh(Command::new("ip").args(["netns", "add", &net.ns]));
        sh(Command::new("ip").args([
            "link",
            "add",
            &net.host_if,
            "type",
            "veth",
            "peer",
            "name",
            &machine_if,
            "netns",
            &net.ns,
        ]));
        let host_cidr = format!("{}/30", net.host_ip);
        sh(Command::new("ip").args(["addr", "add", &host_cidr, "dev", &net.host_if]));
        sh(Command::new("ip").args(["link", "set", &net.host_if, "up"]));
        net.inside(&["addr", "add", &machine_ip, "dev", &machine_if]);
        net.inside(&["link", "set", &machine_if, "up"]);
        net.inside(&["link", "set", "lo", "up"]);
        net
    }

    /// Shapes what the host sends into the namespace to `rate` with tc's token bucket (`80mbit`
    /// is 10 MB/s), as a machine's slower link would.
    pub fn shape(&self, rate: &str) {
        sh(Command::new("tc").args([
            "qdisc",
            "add",
            "dev",
            &self.host_if,
            "root",
            "tbf",
            "rate",
            rate,
            "burst",
            "1mb",
            "latency",
            "100ms",
        ]));
    }

    /// `ip -n NS ARGS`.
    pub fn inside(&self, args: &[&str]) {
        sh(Command::new("ip").args(["-n", &self.ns]).args(args));
    }

    /// One more address of the host that the namespace reaches (through the host's side of the
    /// pair): `{subnet}.{last}`, which must lie outside the pairs (200 and up).
    pub fn add_host_address(&self, last: u8) -> String {
        let ip = format!("{}.{last}", self.subnet);
        sh(Command::new("ip").args(["addr", "add", &format!("{ip}/32"), "dev", &self.host_if]));
        self.inside(&["route", "add", &format!("{ip}/32"), "via", &self.host_ip]);
        ip
    }

    /// Writes the namespace's own hosts file in place (the same file stays mounted over
    /// `/etc/hosts` in processes already started inside, which read it again at each lookup).
    pub fn set_hosts(&self, text: &str) {
        let dir = format!("/etc/netns/{}", self.ns);
        std::fs::create_dir_all(&dir).expect("can create the namespace's /etc folder");
        std::fs::write(format!("{dir}/hosts"), text).expect("can write the namespace's hosts");
    }

    /// `command` run inside the namespace (`ip netns exec`), with its arguments.
    pub fn command(&self, command: &Command) -> Command {
        let mut inside = Command::new("ip");
        inside
            .args(["netns", "exec", &self.ns])
            .arg(command.get_program())
            .args(command.get_args());
        inside
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).status();
        let _ = Command::new("ip")
            .args(["link", "del", &self.host_if])
            .stderr(Stdio::null())
            .status();
        let _ = std::fs::remove_dir_all(format!("/etc/netns/{}", self.ns));
    }
}
