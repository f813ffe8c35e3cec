//! The supervisor's command line, in one place: the binary parses it with [`Invocation::parse`]
//! and callers (the agent) build it with [`Invocation::to_args`] or [`Command::to_args`], so the
//! two sides cannot drift. `parse(to_args(x)) == x` for every invocation whose values the binary
//! accepts (tested below).
//!
//! ```
//! use run_store::cli::{Command, Invocation, Start};
//! use run_store::{Digest, RunId};
//! use std::time::Duration;
//!
//! let id = RunId::parse("build-7").unwrap();
//! let program = Digest::of_reader(&b"#!/bin/sh\n"[..]).unwrap();
//! let mut start = Start::new(&id, &program, ["--verbose", "input.txt"]);
//! start.timeout = Some(Duration::from_millis(1500));
//! start.env.push(("LEVEL".into(), "3".into()));
//! start.inputs.push(("input.txt".into(), "/tmp/input.txt".into()));
//! let invocation = Invocation {
//!     root: Some("/var/lib/octomy-runs".into()),
//!     command: Command::Start(start),
//! };
//! let args = invocation.to_args(); // --root /var/lib/octomy-runs start --run build-7 ...
//! assert_eq!(Invocation::parse(args), Ok(invocation));
//! ```
//!
//! Values are kept as given: the run id, the digest and input names are checked by the command
//! that uses them, and a relative `--root` is resolved by the binary, so each refusal keeps its
//! place and its line.
use crate::{Digest, RunId};
use lexopt::{Arg, Parser, ValueExt};
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
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

/// `--grace` when absent.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(10);
/// `--output-limit` when absent: bytes kept per stream.
pub const DEFAULT_OUTPUT_LIMIT: u64 = 8 * 1024 * 1024;
/// `--keep` when absent: finished runs retained.
pub const DEFAULT_KEEP: usize = 1000;

/// One command line: `fleet-run-supervisor [--root DIR] COMMAND`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Invocation {
    /// `--root` as given (`None`: [`crate::layout::DEFAULT_ROOT`]); the binary makes it absolute.
    pub root: Option<PathBuf>,
    pub command: Command,
}

/// A subcommand and its arguments. Run ids and digests are text here, checked by the command.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    /// `--help`, `-h`, or no command at all.
    Help,
    /// `stage FILE`
    Stage { file: PathBuf },
    /// `start ... -- ARG...`
    Start(Start),
    /// `status --run ID [--json]`
    Status { run: String, json: bool },
    /// `wait --run ID [--json]`
    Wait { run: String, json: bool },
    /// `stop --run ID`
    Stop { run: String },
    /// `collect --run ID --path REL --out FILE`
    Collect {
        run: String,
        path: OsString,
        out: PathBuf,
    },
    /// `list [--json]`
    List { json: bool },
}

/// `start --run ID --program sha256:HEX [...] -- ARG...`; `None` means the flag is absent and
/// its default applies.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Start {
    pub run: String,
    pub program: String,
    /// Must be more than zero; `None`: no timeout.
    pub timeout: Option<Duration>,
    pub grace: Option<Duration>,
    pub output_limit: Option<u64>,
    /// At least 1.
    pub keep: Option<usize>,
    /// `--env NAME=VALUE` in order; a name is not empty and holds no `=` (the first `=` splits).
    pub env: Vec<(OsString, OsString)>,
    /// `--input NAME=FILE` in order; a name holds no `=`.
    pub inputs: Vec<(String, PathBuf)>,
    pub no_cgroup: bool,
    /// The program's arguments after argv[0], any bytes.
    pub args: Vec<OsString>,
}

/// A command line the binary refuses: one line saying what was wrong and what to do.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ParseError(String);

impl From<lexopt::Error> for ParseError {
    fn from(e: lexopt::Error) -> Self {
        ParseError(e.to_string())
    }
}

type Result<T> = std::result::Result<T, ParseError>;

fn error(line: impl Into<String>) -> ParseError {
    ParseError(line.into())
}

impl Start {
    /// A start of `program` as run `run` with these arguments and every flag at its default.
    pub fn new<A: Into<OsString>>(
        run: &RunId,
        program: &Digest,
        args: impl IntoIterator<Item = A>,
    ) -> Start {
        Start {
            run: run.to_string(),
            program: program.to_string(),
            args: args.into_iter().map(Into::into).collect(),
            ..Start::default()
        }
    }

    /// The grace period, default applied.
    pub fn grace_or_default(&self) -> Duration {
        self.grace.unwrap_or(DEFAULT_GRACE)
    }

    /// The output limit, default applied.
    pub fn output_limit_or_default(&self) -> u64 {
        self.output_limit.unwrap_or(DEFAULT_OUTPUT_LIMIT)
    }

    /// The retention count, default applied.
    pub fn keep_or_default(&self) -> usize {
        self.keep.unwrap_or(DEFAULT_KEEP)
    }
}

impl Invocation {
    /// Parses the arguments after the program name.
    pub fn parse(args: impl IntoIterator<Item = OsString>) -> Result<Invocation> {
        let mut p = Parser::from_args(args);
        let mut root = None;
        let name = loop {
            match p.next()? {
                Some(Arg::Long("root")) => root = Some(p.value()?.into()),
                Some(Arg::Long("help")) | Some(Arg::Short('h')) | None => {
                    return Ok(Invocation {
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
            other => {
                return Err(error(format!(
                    "unknown command {other:?}: see fleet-run-supervisor --help"
                )));
            }
        };
        Ok(Invocation { root, command })
    }

    /// The arguments after the program name: `[--root DIR]` then [`Command::to_args`].
    pub fn to_args(&self) -> Vec<OsString> {
        let mut args = Vec::new();
        if let Some(root) = &self.root {
            args.extend(["--root".into(), root.into()]);
        }
        args.extend(self.command.to_args());
        args
    }
}

impl Command {
    /// The subcommand and its arguments, for a caller that puts `--root DIR` first itself.
    pub fn to_args(&self) -> Vec<OsString> {
        let run_flag = |command: &str, run: &str| -> Vec<OsString> {
            vec![command.into(), "--run".into(), run.into()]
        };
        let json_flag = |json: bool| json.then(|| OsString::from("--json"));
        match self {
            Command::Help => vec!["--help".into()],
            // After `--`, a file named like a flag (`-h`) is still the file.
            Command::Stage { file } => vec!["stage".into(), "--".into(), file.into()],
            Command::Start(start) => start.to_args(),
            Command::Status { run, json } => {
                let mut args = run_flag("status", run);
                args.extend(json_flag(*json));
                args
            }
            Command::Wait { run, json } => {
                let mut args = run_flag("wait", run);
                args.extend(json_flag(*json));
                args
            }
            Command::Stop { run } => run_flag("stop", run),
            Command::Collect { run, path, out } => {
                let mut args = run_flag("collect", run);
                args.extend(["--path".into(), path.clone(), "--out".into(), out.into()]);
                args
            }
            Command::List { json } => std::iter::once("list".into())
                .chain(json_flag(*json))
                .collect(),
        }
    }
}

impl Start {
    /// `start ... -- ARG...`: every present flag, then `--`, then the arguments untouched.
    pub fn to_args(&self) -> Vec<OsString> {
        let mut args: Vec<OsString> = vec![
            "start".into(),
            "--run".into(),
            (&self.run).into(),
            "--program".into(),
            (&self.program).into(),
        ];
        if let Some(t) = self.timeout {
            args.extend(["--timeout".into(), seconds_arg(t).into()]);
        }
        if let Some(g) = self.grace {
            args.extend(["--grace".into(), seconds_arg(g).into()]);
        }
        if let Some(b) = self.output_limit {
            args.extend(["--output-limit".into(), b.to_string().into()]);
        }
        if let Some(n) = self.keep {
            args.extend(["--keep".into(), n.to_string().into()]);
        }
        if self.no_cgroup {
            args.push("--no-cgroup".into());
        }
        for (name, value) in &self.env {
            args.extend(["--env".into(), pair(name, value)]);
        }
        for (name, file) in &self.inputs {
            args.extend(["--input".into(), pair(name.as_ref(), file.as_os_str())]);
        }
        args.push("--".into());
        args.extend(self.args.iter().cloned());
        args
    }
}

/// `NAME=VALUE` with the bytes of both as they are.
fn pair(name: &OsStr, value: &OsStr) -> OsString {
    let mut kv = name.to_os_string();
    kv.push("=");
    kv.push(value);
    kv
}

/// Seconds as the parser reads them back exactly: whole seconds, or a decimal fraction of at
/// most 9 digits (nanoseconds) without trailing zeros, e.g. `10`, `0.25`, `1.5`.
pub fn seconds_arg(d: Duration) -> String {
    match d.subsec_nanos() {
        0 => d.as_secs().to_string(),
        nanos => {
            let fraction = format!("{nanos:09}");
            format!("{}.{}", d.as_secs(), fraction.trim_end_matches('0'))
        }
    }
}

fn parse_start(p: &mut Parser) -> Result<Start> {
    let (mut run, mut program) = (None, None);
    let mut start = Start::default();
    while let Some(arg) = p.next()? {
        match arg {
            Arg::Long("run") => run = Some(p.value()?.string()?),
            Arg::Long("program") => program = Some(p.value()?.string()?),
            Arg::Long("timeout") => start.timeout = Some(seconds(p, "--timeout", false)?),
            Arg::Long("grace") => start.grace = Some(seconds(p, "--grace", true)?),
            Arg::Long("output-limit") => start.output_limit = Some(number(p, "--output-limit")?),
            Arg::Long("keep") => {
                let keep = number(p, "--keep")?;
                if keep == 0 {
                    return Err(error(
                        "bad --keep 0: keep at least the run that just finished",
                    ));
                }
                start.keep = Some(keep);
            }
            Arg::Long("no-cgroup") => start.no_cgroup = true,
            Arg::Long("env") => {
                let kv = p.value()?;
                let (k, v) = split_pair(&kv)
                    .filter(|(k, _)| !k.is_empty())
                    .ok_or_else(|| error(format!("bad --env {kv:?}: use --env NAME=VALUE")))?;
                start.env.push((k.into(), v.into()));
            }
            Arg::Long("input") => {
                let kv = p.value()?;
                let (name, file) = split_pair(&kv)
                    .and_then(|(n, f)| Some((n.to_str()?.to_string(), PathBuf::from(f))))
                    .ok_or_else(|| error(format!("bad --input {kv:?}: use --input NAME=FILE")))?;
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

fn split_pair(kv: &OsStr) -> Option<(&OsStr, &OsStr)> {
    let bytes = kv.as_bytes();
    let at = bytes.iter().position(|&b| b == b'=')?;
    Some((
        OsStr::from_bytes(&bytes[..at]),
        OsStr::from_bytes(&bytes[at + 1..]),
    ))
}

fn seconds(p: &mut Parser, flag: &str, zero_ok: bool) -> Result<Duration> {
    let text = p.value()?.string()?;
    parse_seconds(&text, zero_ok).ok_or_else(|| {
        error(format!(
            "bad {flag} {text:?}: give a number of seconds such as 10 or 0.5"
        ))
    })
}

/// A plain decimal (what [`seconds_arg`] writes) is read exactly, to the nanosecond; any other
/// number (`1e3`) goes through `f64` as before.
fn parse_seconds(text: &str, zero_ok: bool) -> Option<Duration> {
    let (whole, fraction) = text.split_once('.').unwrap_or((text, ""));
    let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    let plain = digits(whole) && digits(fraction) && whole.len() <= 9 && fraction.len() <= 9;
    if plain && !(whole.is_empty() && fraction.is_empty()) {
        // Below 1e9 seconds by its length, like the check below.
        let secs = if whole.is_empty() {
            0
        } else {
            whole.parse().ok()?
        };
        let nanos = format!("{fraction:0<9}").parse().ok()?;
        let d = Duration::new(secs, nanos);
        return (zero_ok || !d.is_zero()).then_some(d);
    }
    text.parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && (*s > 0.0 || (zero_ok && *s == 0.0)) && *s < 1e9)
        .map(Duration::from_secs_f64)
}

fn number<T: std::str::FromStr>(p: &mut Parser, flag: &str) -> Result<T> {
    let text = p.value()?.string()?;
    text.parse()
        .map_err(|_| error(format!("bad {flag} {text:?}: give a whole number")))
}

fn required_value(p: &mut Parser, what: &str) -> Result<OsString> {
    match p.next()? {
        Some(Arg::Value(v)) => Ok(v),
        Some(other) => Err(unexpected(other)),
        None => Err(error(format!(
            "stage needs {what}: see fleet-run-supervisor --help"
        ))),
    }
}

fn missing(command: &str, what: &str) -> ParseError {
    error(format!(
        "{command} needs {what}: see fleet-run-supervisor --help"
    ))
}

fn unexpected(arg: Arg) -> ParseError {
    let shown = match arg {
        Arg::Long(l) => format!("--{l}"),
        Arg::Short(s) => format!("-{s}"),
        Arg::Value(v) => v.to_string_lossy().into_owned(),
    };
    error(format!(
        "unexpected argument {shown:?}: see fleet-run-supervisor --help"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::ffi::OsStringExt;

    fn os(bytes: &[u8]) -> OsString {
        OsString::from_vec(bytes.to_vec())
    }

    fn round_trip(invocation: Invocation) {
        let args = invocation.to_args();
        assert_eq!(Invocation::parse(args.clone()), Ok(invocation), "{args:?}");
    }

    fn start() -> Start {
        let id = RunId::parse("build-1.2_x").unwrap();
        let digest = Digest::of_reader(&b"program"[..]).unwrap();
        Start::new(&id, &digest, ["--flag", "-x", "--", ""])
    }

    #[test]
    fn every_start_field_round_trips_through_to_args_and_parse() {
        let full = Start {
            timeout: Some(Duration::from_millis(250)),
            grace: Some(Duration::from_millis(1500)),
            output_limit: Some(1),
            keep: Some(7),
            env: vec![
                ("A".into(), "1".into()),
                (os(b"B\xff"), os(b"x=y\xfe z")),
                ("EMPTY".into(), "".into()),
            ],
            inputs: vec![
                ("data.bin".into(), PathBuf::from("/tmp/in put/da=ta")),
                ("rel".into(), PathBuf::from(os(b"relative/\xff.txt"))),
            ],
            no_cgroup: true,
            args: vec![
                os(b"\xff\xfe not utf-8"),
                "--".into(),
                "--run".into(),
                "-h".into(),
                "".into(),
                "a b\n$(c)".into(),
                "--env=X".into(),
            ],
            ..start()
        };
        assert_eq!(full.run, "build-1.2_x");
        assert!(full.program.starts_with("sha256:"));
        for root in [
            None,
            Some(PathBuf::from(os(b"/srv/r\xffuns"))),
            Some("rel".into()),
        ] {
            round_trip(Invocation {
                root,
                command: Command::Start(full.clone()),
            });
        }
        // Every optional absent, and no arguments at all.
        let bare = Start {
            args: Vec::new(),
            ..start()
        };
        round_trip(Invocation {
            root: None,
            command: Command::Start(bare.clone()),
        });
        let args = Command::Start(bare).to_args();
        assert_eq!(args.len(), 6, "{args:?}");
        assert_eq!(args.last().unwrap(), "--");
    }

    #[test]
    fn durations_round_trip_to_the_nanosecond() {
        for d in [
            Duration::from_millis(250),
            Duration::from_millis(1500),
            Duration::from_secs(10),
            Duration::from_nanos(1),
            Duration::new(999_999_999, 999_999_999),
            Duration::new(3600, 100_000_000),
        ] {
            let start = Start {
                timeout: Some(d),
                grace: Some(d),
                ..start()
            };
            round_trip(Invocation {
                root: None,
                command: Command::Start(start),
            });
        }
        assert_eq!(seconds_arg(Duration::from_millis(250)), "0.25");
        assert_eq!(seconds_arg(Duration::from_millis(1500)), "1.5");
        assert_eq!(seconds_arg(Duration::from_secs(10)), "10");
        let zero_grace = Start {
            grace: Some(Duration::ZERO),
            ..start()
        };
        round_trip(Invocation {
            root: None,
            command: Command::Start(zero_grace),
        });
    }

    #[test]
    fn seconds_read_as_before_and_plain_decimals_exactly() {
        let read = |text: &str, zero_ok: bool| parse_seconds(text, zero_ok);
        assert_eq!(read("0.5", false), Some(Duration::from_millis(500)));
        assert_eq!(read(".5", false), Some(Duration::from_millis(500)));
        assert_eq!(read("5.", false), Some(Duration::from_secs(5)));
        assert_eq!(read("1e3", false), Some(Duration::from_secs(1000)));
        assert_eq!(read("+2", false), Some(Duration::from_secs(2)));
        assert_eq!(read("0", true), Some(Duration::ZERO));
        assert_eq!(
            read("123456789.123456789", false),
            Some(Duration::new(123_456_789, 123_456_789))
        );
        for bad in [
            "0",
            "0.000",
            "",
            ".",
            "-1",
            "1e9",
            "1000000000",
            "inf",
            "NaN",
            "x",
        ] {
            assert_eq!(read(bad, false), None, "{bad:?}");
        }
    }

    #[test]
    fn every_other_command_round_trips() {
        let root = Some(PathBuf::from("/var/lib/runs"));
        let commands = [
            Command::Help,
            Command::Stage {
                file: os(b"/tmp/pro gram\xff").into(),
            },
            Command::Stage { file: "-h".into() },
            Command::Status {
                run: "r1".into(),
                json: false,
            },
            Command::Status {
                run: "r1".into(),
                json: true,
            },
            Command::Wait {
                run: "r1".into(),
                json: true,
            },
            Command::Wait {
                run: "r1".into(),
                json: false,
            },
            Command::Stop { run: "r1".into() },
            Command::Collect {
                run: "r1".into(),
                path: os(b"out/\xffdata"),
                out: "/tmp/o ut".into(),
            },
            Command::Collect {
                run: "-r".into(),
                path: "--json".into(),
                out: "-".into(),
            },
            Command::List { json: false },
            Command::List { json: true },
        ];
        for command in commands {
            for root in [None, root.clone()] {
                round_trip(Invocation {
                    root,
                    command: command.clone(),
                });
            }
        }
    }

    #[test]
    fn refusals_keep_their_lines() {
        let parse = |args: &[&str]| {
            Invocation::parse(args.iter().map(OsString::from))
                .unwrap_err()
                .to_string()
        };
        let help = "see fleet-run-supervisor --help";
        assert_eq!(
            parse(&["start", "--run", "a"]),
            format!("start needs --program sha256:HEX: {help}")
        );
        assert_eq!(
            parse(&["nope"]),
            format!("unknown command \"nope\": {help}")
        );
        assert_eq!(
            parse(&["list", "--run", "a"]),
            format!("unexpected argument \"--run\": {help}")
        );
        assert_eq!(
            parse(&["start", "--run", "a", "--program", "p", "--env", "=x"]),
            "bad --env \"=x\": use --env NAME=VALUE"
        );
        assert_eq!(
            parse(&["start", "--timeout", "0"]),
            "bad --timeout \"0\": give a number of seconds such as 10 or 0.5"
        );
        assert_eq!(
            parse(&["start", "--keep", "0"]),
            "bad --keep 0: keep at least the run that just finished"
        );
        assert_eq!(
            parse(&["stop", "--run"]),
            "missing argument for option '--run'"
        );
    }
}
