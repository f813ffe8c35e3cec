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
        std::process::exit(1);
    }
}

/// One thread serves everything (the work is I/O bound and memory stays small); blocking calls
/// go to tokio's blocking pool.
pub fn async_runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    use anyhow::Context;
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
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
