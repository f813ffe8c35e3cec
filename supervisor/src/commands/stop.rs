//! `stop`: asks a run's supervisor to end it the way its timeout would, then waits for the end.
use super::show;
use anyhow::{Result, bail};
use run_store::{State, Store};
use std::time::Duration;

pub fn run(store: &Store, run: &str) -> Result<()> {
    loop {
        let s = show::status(store, run)?;
        match (s.state, &s.owner) {
            (state, _) if state.is_final() => break,
            // Still starting: the detached supervisor takes over within moments.
            (State::Starting, _) => std::thread::sleep(Duration::from_millis(5)),
            (State::Running, Some(owner)) => {
                // SIGTERM to the supervisor itself, which then terminates the whole tree.
                if !crate::sys::signal_exists(owner.pid as libc::pid_t, libc::SIGTERM)
                    && owner.is_alive()
                {
                    bail!(
                        "cannot signal the supervisor of run {run:?} (pid {}): {}",
                        owner.pid,
                        run_store::describe_io(&std::io::Error::last_os_error())
                    );
                }
                break;
            }
            _ => std::thread::sleep(Duration::from_millis(5)),
        }
    }
    show::wait(store, run, false)
}
