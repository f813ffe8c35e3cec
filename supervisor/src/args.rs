//! The command line, parsed into plain values (handlers live in `commands/`).
use anyhow::{Result, anyhow, bail};
use lexopt::{Arg, Parser, ValueExt};
use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

pub const USAGE: &str = "\
usage: fleet-run-supervisor [--root DIR] COMMAND

  stage FILE                          copy a program into the store, print sha256:HEX
  start --run ID --program sha256:HEX [--timeout SECS] [--grace SECS]
        [--output-limit BYTES] [--keep N] [--env K=V]... [--input NAME=FILE]...
        [--no-cgroup] -- ARG...       start a run, print its state once exec'd
  status --run ID [--json]            a run's state and the ends of its output
  wait   --run ID [--json]            wait until a run is final, then as status
  stop   --run ID                     end a run like its timeout, then as wait
  collect --run ID --path REL --out FILE
                                      copy a file out of a run, print sha256:HEX
  list [--json]                       every run and its state

  --root DIR   the store (default /var/lib/octomy-runs)
  see docs/supervisor.md for the steps, the environment and result.json
";

pub const DEFAULT_GRACE: Duration = Duration::from_secs(10);
pub const DEFAULT_OUTPUT_LIMIT: u64 = 8 * 1024 * 1024;
pub const DEFAULT_KEEP: usize = 1000;

pub struct Cli {
    pub root: PathBuf,
    pub command: Command,
}

pub enum Command {
    Help,
    Stage {
        file: PathBuf,
    },
    Start(Start),
    Status {
        run: String,
        json: bool,
    },
    Wait {
        run: String,
        json: bool,
    },
    Stop {
        run: String,
    },
    Collect {
        run: String,
        path: OsString,
        out: PathBuf,
    },
    List {
        json: bool,
    },
}

pub struct Start {
    pub run: String,
    pub program: String,
    pub timeout: Option<Duration>,
    pub grace: Duration,
    pub output_limit: u64,
    pub keep: usize,
    pub env: Vec<(OsString, OsString)>,
    pub inputs: Vec<(String, PathBuf)>,
    pub no_cgroup: bool,
    pub args: Vec<OsString>,
}

pub fn parse(args: impl IntoIterator<Item = OsString>) -> Result<Cli> {
    let mut p = Parser::from_args(args);
    let mut root = PathBuf::from(run_store::layout::DEFAULT_ROOT);
    let name = loop {
        match p.next()? {
            Some(Arg::Long("root")) => root = p.value()?.into(),
            Some(Arg::Long("help")) | Some(Arg::Short('h')) | None => {
                return Ok(Cli {
                    root,
                    command: Command::Help,
                });
            }
            Some(Arg::Value(v)) => break v.string()?,
            Some(other) => return Err(unexpected(other)),
        }
    };
    let command = match name.as_str() {
        "stage" => Command::Stage {
            file: required_value(&mut p, "FILE")?.into(),
        },
        "start" => Command::Start(parse_start(&mut p)?),
        "status" | "wait" | "list" | "stop" => {
            let (mut run, mut json) = (None, false);
            while let Some(arg) = p.next()? {
                match arg {
                    Arg::Long("run") if name != "list" => run = Some(p.value()?.string()?),
                    Arg::Long("json") if name != "stop" => json = true,
                    other => return Err(unexpected(other)),
                }
            }
            let run = || run.clone().ok_or_else(|| missing(&name, "--run ID"));
            match name.as_str() {
                "status" => Command::Status { run: run()?, json },
                "wait" => Command::Wait { run: run()?, json },
                "stop" => Command::Stop { run: run()? },
                _ => Command::List { json },
            }
        }
        "collect" => {
            let (mut run, mut path, mut out) = (None, None, None);
            while let Some(arg) = p.next()? {
                match arg {
                    Arg::Long("run") => run = Some(p.value()?.string()?),
                    Arg::Long("path") => path = Some(p.value()?),
                    Arg::Long("out") => out = Some(PathBuf::from(p.value()?)),
                    other => return Err(unexpected(other)),
                }
            }
            Command::Collect {
                run: run.ok_or_else(|| missing("collect", "--run ID"))?,
                path: path.ok_or_else(|| missing("collect", "--path REL"))?,
                out: out.ok_or_else(|| missing("collect", "--out FILE"))?,
            }
        }
        other => bail!("unknown command {other:?}: see fleet-run-supervisor --help"),
    };
    Ok(Cli {
        root: absolute_root(root)?,
        command,
    })
}

/// The detached supervisor runs in `/` and the program in its run folder, so a relative
/// `--root` is resolved once, here, against the caller's folder.
fn absolute_root(root: PathBuf) -> Result<PathBuf> {
    std::path::absolute(&root).map_err(|e| {
        let reason = run_store::describe_io(&e);
        anyhow!("bad --root {root:?}: {reason}; give the store folder's path")
    })
}

fn parse_start(p: &mut Parser) -> Result<Start> {
    let (mut run, mut program) = (None, None);
    let mut start = Start {
        run: String::new(),
        program: String::new(),
        timeout: None,
        grace: DEFAULT_GRACE,
        output_limit: DEFAULT_OUTPUT_LIMIT,
        keep: DEFAULT_KEEP,
        env: Vec::new(),
        inputs: Vec::new(),
        no_cgroup: false,
        args: Vec::new(),
    };
    while let Some(arg) = p.next()? {
        match arg {
            Arg::Long("run") => run = Some(p.value()?.string()?),
            Arg::Long("program") => program = Some(p.value()?.string()?),
            Arg::Long("timeout") => start.timeout = Some(seconds(p, "--timeout", false)?),
            Arg::Long("grace") => start.grace = seconds(p, "--grace", true)?,
            Arg::Long("output-limit") => start.output_limit = number(p, "--output-limit")?,
            Arg::Long("keep") => {
                start.keep = number(p, "--keep")?;
                if start.keep == 0 {
                    bail!("bad --keep 0: keep at least the run that just finished");
                }
            }
            Arg::Long("no-cgroup") => start.no_cgroup = true,
            Arg::Long("env") => {
                let kv = p.value()?;
                let (k, v) = split_pair(&kv)
                    .filter(|(k, _)| !k.is_empty())
                    .ok_or_else(|| anyhow!("bad --env {kv:?}: use --env NAME=VALUE"))?;
                start.env.push((k.into(), v.into()));
            }
            Arg::Long("input") => {
                let kv = p.value()?;
                let (name, file) = split_pair(&kv)
                    .and_then(|(n, f)| Some((n.to_str()?.to_string(), PathBuf::from(f))))
                    .ok_or_else(|| anyhow!("bad --input {kv:?}: use --input NAME=FILE"))?;
                start.inputs.push((name, file));
            }
            // Everything after `--` is the program's, untouched.
            Arg::Value(v) => start.args.push(v),
            other => return Err(unexpected(other)),
        }
    }
    start.run = run.ok_or_else(|| missing("start", "--run ID"))?;
    start.program = program.ok_or_else(|| missing("start", "--program sha256:HEX"))?;
    Ok(start)
}

fn split_pair(kv: &std::ffi::OsStr) -> Option<(&std::ffi::OsStr, &std::ffi::OsStr)> {
    use std::os::unix::ffi::OsStrExt;
    let bytes = kv.as_bytes();
    let at = bytes.iter().position(|&b| b == b'=')?;
    Some((
        std::ffi::OsStr::from_bytes(&bytes[..at]),
        std::ffi::OsStr::from_bytes(&bytes[at + 1..]),
    ))
}

fn seconds(p: &mut Parser, flag: &str, zero_ok: bool) -> Result<Duration> {
    let text = p.value()?.string()?;
    text.parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && (*s > 0.0 || (zero_ok && *s == 0.0)) && *s < 1e9)
        .map(Duration::from_secs_f64)
        .ok_or_else(|| anyhow!("bad {flag} {text:?}: give a number of seconds such as 10 or 0.5"))
}

fn number<T: std::str::FromStr>(p: &mut Parser, flag: &str) -> Result<T> {
    let text = p.value()?.string()?;
    text.parse()
        .map_err(|_| anyhow!("bad {flag} {text:?}: give a whole number"))
}

fn required_value(p: &mut Parser, what: &str) -> Result<OsString> {
    match p.next()? {
        Some(Arg::Value(v)) => Ok(v),
        Some(other) => Err(unexpected(other)),
        None => Err(anyhow!(
            "stage needs {what}: see fleet-run-supervisor --help"
        )),
    }
}

fn missing(command: &str, what: &str) -> anyhow::Error {
    anyhow!("{command} needs {what}: see fleet-run-supervisor --help")
}

fn unexpected(arg: Arg) -> anyhow::Error {
    let shown = match arg {
        Arg::Long(l) => format!("--{l}"),
        Arg::Short(s) => format!("-{s}"),
        Arg::Value(v) => v.to_string_lossy().into_owned(),
    };
    anyhow!("unexpected argument {shown:?}: see fleet-run-supervisor --help")
}
