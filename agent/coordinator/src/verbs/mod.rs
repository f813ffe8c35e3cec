//! The binary's commands: each file builds its commands from the CLI's arguments, sends them
//! through [`operate`] and prints their answers.
pub mod nodes;
pub mod releases;
pub mod runs;
pub mod serve;
pub mod tokens;

use anyhow::{Context, Result};
use fleet_cli::binary;
use fleet_coordinator::commands::{self, Operation, Request, Response};
use fleet_coordinator::{self as coordinator, Coordinator, StoreLocation, operator};
use std::sync::Arc;
use std::time::Duration;

/// The data folder (key, operator socket, embedded store) and where the store is.
pub struct Place {
    pub data: std::path::PathBuf,
    pub store: StoreLocation,
}

/// How long an operator command or `serve` waits for the other to let go of the store.
pub const STORE_PATIENCE: Duration = Duration::from_secs(10);

/// Through the serving coordinator's socket when it runs, else on the store directly. The store
/// is held only for this one request; a `serve` starting meanwhile waits for it (see
/// [`STORE_PATIENCE`]), and when `serve` holds it first this command goes through its socket.
pub fn operate<C: Operation>(place: &Place, command: C) -> Result<C::Answer> {
    let request: Request = command.into();
    let data = &place.data;
    let deadline = std::time::Instant::now() + STORE_PATIENCE;
    let response = loop {
        match operator::call(data, &request) {
            Some(Ok(answer)) => break answer,
            // The serving coordinator went away mid-request: a read is asked again (of the next
            // one, or of the store); a change is not, since it may have been applied.
            Some(Err(_)) if request.is_read_only() && std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            Some(Err(e)) => {
                return Err(e).context(
                    "the serving coordinator did not answer on its socket; check with `status` whether the request was applied",
                );
            }
            None => {}
        }
        if place.store == StoreLocation::Embedded && data.join(coordinator::POSTGRES_MARK).exists()
        {
            anyhow::bail!(
                "no coordinator answers on {}'s socket, and its fleet's store is in PostgreSQL: start `fleet-coordinator serve` on it again, or pass --store postgres://... to act on the store directly",
                data.display()
            );
        }
        match Coordinator::open(data, &place.store) {
            Ok(coordinator) => {
                break binary::async_runtime()?.block_on(commands::handle(
                    Arc::new(coordinator),
                    None,
                    request,
                ));
            }
            // `serve` holds the store and is about to open its socket.
            Err(coordinator::CoordinatorError::Store(
                fleet_coordinator::store::StoreError::Locked(_),
            )) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(e.into()),
        }
    };
    match response {
        Response::Ok(answer) => serde_json::from_value(answer).map_err(|e| {
            anyhow::anyhow!(
                "the serving coordinator answered with another kind of answer ({e}): run the CLI of the serving coordinator's version"
            )
        }),
        Response::Error(e) => Err(anyhow::anyhow!(e)),
    }
}
