//! What both binaries do around their work: logging set up once, a fatal error printed as one
//! line (and logged too in JSON mode), a one-thread async runtime, and the stop signals.
use crate::logging::{self, LogFormat};

/// Sets up logging, runs `body`, and exits 1 with `NAME: error` on stderr when it fails.
pub fn run(name: &str, format: LogFormat, body: impl FnOnce() -> anyhow::Result<()>) {
    logging::init(format);
    if let Err(err) = body() {
        // A JSON log carries the fatal line too, for collectors; a human reads it once on stderr.
        if format == LogFormat::Json {
            tracing::error!("{err:#}");
        }
        eprintln!("{name}: {err:#}");
        std::process::exit(err.downcast_ref::<ExitWith>().map_or(1, |e| e.status));
    }
}

/// A fatal error that ends the program with its own exit status (one a service manager reads,
/// such as a unit's `RestartPreventExitStatus`) instead of 1.
#[derive(Debug)]
pub struct ExitWith {
    pub status: i32,
    pub message: String,
}

impl std::fmt::Display for ExitWith {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ExitWith {}

/// Tokio's own bound on its blocking pool.
const TOKIO_BLOCKING_THREADS: usize = 512;

/// One thread serves everything (the work is I/O bound and memory stays small); blocking calls
/// go to tokio's blocking pool.
pub fn async_runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    async_runtime_lending(TOKIO_BLOCKING_THREADS)
}

/// [`async_runtime`] with at most `blocking_threads` in its blocking pool.
pub fn async_runtime_lending(blocking_threads: usize) -> anyhow::Result<tokio::runtime::Runtime> {
    use anyhow::Context;
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .max_blocking_threads(blocking_threads)
        .build()
        .context("cannot start the async runtime")
}

/// Resolves on SIGTERM or SIGINT.
pub async fn stop_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    // Cannot fail: at start-up only, inside a runtime with signals enabled.
    let mut term = signal(SignalKind::terminate()).expect("can watch SIGTERM");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}
