//! The fleet's real processes for the demo, the soak and the agent benchmark: a coordinator serving
//! on loopback, agents started against a machine folder, coordinator CLI calls, and waiting for
//! the log lines that say a process got somewhere.
use crate::{cross, util};
use anyhow::{Context, Result, bail};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Builds the debug agent, coordinator, supervisor and oci; returns the agent's path (the others
/// sit beside it).
pub fn build_debug() -> Result<PathBuf> {
    build("debug")
}

/// Like [`build_debug`], in the release profile (what ships).
pub fn build_release() -> Result<PathBuf> {
    build("release")
}

fn build(profile: &str) -> Result<PathBuf> {
    util::run(Command::new("cargo").args([
        "build",
        "--quiet",
        "--profile",
        if profile == "debug" { "dev" } else { profile },
        "-p",
        "fleet-agent",
        "-p",
        "fleet-coordinator",
        "-p",
        "fleet-run-supervisor",
        "-p",
        "oci",
    ]))?;
    Ok(cross::target_dir().join(profile).join("fleet-agent"))
}

/// A fresh, empty `target/<name>` folder for one task's files.
pub fn fresh_dir(name: &str) -> Result<PathBuf> {
    let dir = cross::target_dir().join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// A child process SIGKILLed when dropped, however the task ends.
pub struct Proc(pub Child);

impl Proc {
    pub fn spawn(cmd: &mut Command) -> Result<Proc> {
        Ok(Proc(cmd.spawn().with_context(|| {
            format!("cannot start {:?}", cmd.get_program())
        })?))
    }

    pub fn stop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.stop();
    }
}

/// `fleet-coordinator serve` on a free loopback port, killed when dropped.
pub struct Coordinator {
    pub bin: PathBuf,
    pub data: PathBuf,
    pub addr: String,
    proc: Proc,
}

impl Coordinator {
    /// Starts serving `data` with the `serve` flags given, its log going to `stderr`, and waits
    /// for the address it prints. `agent` is the agent binary; the coordinator's sits beside it.
    pub fn serve(agent: &Path, data: &Path, flags: &[&str], stderr: Stdio) -> Result<Coordinator> {
        Coordinator::serve_at(agent, data, "127.0.0.1:0", flags, stderr)
    }

    /// Like [`Coordinator::serve`], listening on `listen` (the address it had before a restart).
    pub fn serve_at(
        agent: &Path,
        data: &Path,
        listen: &str,
        flags: &[&str],
        stderr: Stdio,
    ) -> Result<Coordinator> {
        let bin = agent.with_file_name("fleet-coordinator");
        let mut proc = Proc::spawn(
            Command::new(&bin)
                .arg("--data")
                .arg(data)
                .args(["serve", "--listen", listen])
                .args(metrics_default(flags))
                .args(flags)
                .stdout(Stdio::piped())
                .stderr(stderr),
        )?;
        let mut line = String::new();
        BufReader::new(proc.0.stdout.take().expect("piped")).read_line(&mut line)?;
        let Some(addr) = line.trim().strip_prefix("listening on ") else {
            bail!("the coordinator printed {line:?} instead of its address");
        };
        Ok(Coordinator {
            bin,
            data: data.to_path_buf(),
            addr: addr.to_string(),
            proc,
        })
    }

    /// One request on the serving coordinator's operator socket (`DATA/operator.sock`, a JSON
    /// line each way), as the `fleet-coordinator` CLI asks it, without starting a process;
    /// returns the answer of the kind `kind` (`{"ok": {KIND: ANSWER}}`).
    pub fn ask(&self, request: &serde_json::Value, kind: &str) -> Result<serde_json::Value> {
        use std::io::Write;
        let stream = std::os::unix::net::UnixStream::connect(self.data.join("operator.sock"))?;
        writeln!(&stream, "{request}")?;
        let mut line = String::new();
        BufReader::new(&stream).read_line(&mut line)?;
        let mut answer: serde_json::Value = serde_json::from_str(&line)?;
        match answer.get_mut("ok").and_then(|ok| ok.get_mut(kind)) {
            Some(ok) => Ok(ok.take()),
            None => bail!("the coordinator answered {request} with {}", line.trim()),
        }
    }

    /// Runs `fleet-coordinator --data DATA ARGS` (answered through the serving process's socket)
    /// and returns its stdout.
    pub fn cli(&self, args: &[&str]) -> Result<String> {
        let out = Command::new(&self.bin)
            .arg("--data")
            .arg(&self.data)
            .args(args)
            .output()?;
        if !out.status.success() {
            bail!(
                "coordinator {} failed: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The serving process's id.
    pub fn pid(&self) -> u32 {
        self.proc.0.id()
    }

    /// `run --all --program PROGRAM REST...`; returns the set id.
    pub fn run_set(&self, program: &Path, rest: &[&str]) -> Result<String> {
        let program = program.to_string_lossy();
        let mut args = vec!["run", "--all", "--program", &program];
        args.extend_from_slice(rest);
        Ok(self.cli(&args)?.trim().to_string())
    }

    pub fn stop(&mut self) {
        self.proc.stop();
    }

    /// SIGTERM, as an operator's restart: the coordinator drains and exits; waits for it.
    pub fn terminate(&mut self) -> Result<()> {
        // SAFETY: kill sends a signal to our own child, which has not been waited for yet.
        if unsafe { libc::kill(self.proc.0.id() as libc::pid_t, libc::SIGTERM) } != 0 {
            bail!(
                "cannot signal the coordinator: {}",
                std::io::Error::last_os_error()
            );
        }
        self.proc.0.wait()?;
        Ok(())
    }
}

/// An agent joining with `join`, keeping its state, run store and cloud-init folder under
/// `machine`, with no accelerator tool; callers add their own flags and where its output goes.
/// Metrics on a free port unless `flags` choose: several coordinators may share this machine.
fn metrics_default(flags: &[&str]) -> &'static [&'static str] {
    match flags.contains(&"--metrics-listen") {
        true => &[],
        false => &["--metrics-listen", "127.0.0.1:0"],
    }
}

pub fn agent(bin: &Path, join: &Path, machine: &Path) -> Command {
    let mut cmd = Command::new(bin);
    cmd.arg("--join-file")
        .arg(join)
        .arg("--state")
        .arg(machine.join("state"))
        .arg("--run-store")
        .arg(machine.join("runs"))
        .arg("--cloud-root")
        .arg(machine.join("cloud"))
        .args(["--accelerator-tool", "/nonexistent/nvidia-smi"]);
    cmd
}

/// Writes an executable `#!/bin/sh` program.
pub fn script(path: &Path, body: &str) -> Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, format!("#!/bin/sh\n{body}\n"))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))?;
    Ok(path.to_path_buf())
}

/// Waits until the log file contains `needle`.
pub fn wait_for_log(log: &Path, needle: &str, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if std::fs::read_to_string(log)
            .unwrap_or_default()
            .contains(needle)
        {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    bail!(
        "no `{needle}` in {} after {} s",
        log.display(),
        timeout.as_secs()
    )
}

/// Reads a piped log until a line contains `needle`; fails when the log ends first.
pub fn wait_for_line(
    lines: &mut impl Iterator<Item = std::io::Result<String>>,
    needle: &str,
) -> Result<()> {
    for line in lines {
        if line?.contains(needle) {
            return Ok(());
        }
    }
    bail!("the agent exited before its log said `{needle}`")
}
