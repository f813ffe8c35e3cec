//! `fleet-run-supervisor`: stages programs by digest, starts runs detached, and reads the store.
mod args;
mod commands;
mod supervise;
mod sys;

use args::Command;
use run_store::Store;

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
    let cli = args::parse(std::env::args_os().skip(1))?;
    let store = Store::new(cli.root);
    match cli.command {
        Command::Help => {
            print!("{}", args::USAGE);
            Ok(0)
        }
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
