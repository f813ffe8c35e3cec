//! The `fleet-coordinator` binary: wiring only. `cli.rs` holds the arguments; each command is
//! built, sent and printed in `verbs/`; what it does is in the library's `commands`.
mod cli;
mod verbs;

use anyhow::Result;
use clap::Parser;
use cli::{Cli, Command};
use fleet_cli::binary;
use fleet_coordinator::StoreLocation;
use verbs::{Place, nodes, releases, runs, serve, tokens};

// jemalloc, not musl's allocator: musl's kept what a crowd of sessions or a dispatch freed, so
// the RSS climbed with every restart in the fleet (docs/decisions/, the coordinator's allocator).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() {
    let cli = Cli::parse();
    binary::run("fleet-coordinator", cli.log_format, || run_coordinator(cli));
}

fn run_coordinator(args: Cli) -> Result<()> {
    let store = match &args.store {
        Some(url) => StoreLocation::parse(url)?,
        None => StoreLocation::Embedded,
    };
    let place = &Place {
        data: args.data,
        store,
    };
    match args.command {
        Command::Token(t) => tokens::token(place, t),
        Command::UserData(u) => tokens::user_data(place, u),
        Command::Serve(s) => serve::serve_coordinator(place, s),
        Command::Nodes(n) => nodes::nodes(place, n),
        Command::Check(c) => nodes::check(place, c),
        Command::Label(l) => nodes::label(place, l),
        Command::Capacity(c) => nodes::capacity(place, c),
        Command::Drain(d) => nodes::drain(place, d),
        Command::Retire(r) => nodes::retire(place, r),
        Command::Revoke(r) => nodes::revoke(place, r),
        Command::Forget(f) => nodes::forget(place, f),
        Command::Run(r) => runs::run(place, r),
        Command::Status(s) => runs::status(place, s),
        Command::Collect(c) => runs::collect(place, c),
        Command::Replicate(r) => runs::replicate(place, r),
        Command::Stop(s) => runs::stop(place, s),
        Command::Policy(p) => runs::policy(&place.data, &p),
        Command::Release(r) => releases::release(place, r),
        Command::Rollout(r) => releases::rollout(place, r),
        Command::Update(u) => releases::update(place, u),
    }
}
