//! `fleet-run-supervisor`: stages programs by digest, starts runs detached, and reads the store.
mod commands;
mod supervise;
mod sys;

use anyhow::anyhow;
use run_store::Store;
use run_store::cli::{Command, Invocation, USAGE};
use std::path::PathBuf;

fn main() {
    // Like any Unix tool, end quietly when a reader (`| head`) goes away.
    // SAFETY: setting a signal's disposition to its default touches no Rust state.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let code = match run() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("fleet-run-supervisor: {e:#}");
            // Distinct statuses per refusal class, so callers never parse the message.
            commands::exit_code(&e)
        }
    };
    std::process::exit(code);
}

fn run() -> anyhow::Result<i32> {
    let cli = Invocation::parse(std::env::args_os().skip(1))?;
    if cli.command == Command::Help {
        print!("{USAGE}");
        return Ok(0);
    }
    let root = cli
        .root
        .unwrap_or_else(|| run_store::layout::DEFAULT_ROOT.into());
    let store = Store::new(absolute_root(root)?);
    match cli.command {
        Command::Help => Ok(0), // printed above, before the root is resolved
        Command::Stage { file } => commands::stage::run(&store, &file).map(|()| 0),
        Command::Start(start) => commands::start::run(&store, start),
        Command::Status { run, json } => {
            commands::show::print_status(&store, &run, json).map(|()| 0)
        }
        Command::Wait { run, json } => commands::show::wait(&store, &run, json).map(|()| 0),
        Command::Stop { run } => commands::stop::run(&store, &run).map(|()| 0),
        Command::Collect { run, path, out } => {
            commands::collect::run(&store, &run, &path, &out).map(|()| 0)
        }
        Command::List { json } => commands::show::list(&store, json).map(|()| 0),
    }
}

/// The detached supervisor runs in `/` and the program in its run folder, so a relative
/// `--root` is resolved once, here, against the caller's folder.
fn absolute_root(root: PathBuf) -> anyhow::Result<PathBuf> {
    std::path::absolute(&root).map_err(|e| {
        let reason = run_store::describe_io(&e);
        anyhow!("bad --root {root:?}: {reason}; give the store folder's path")
    })
}
