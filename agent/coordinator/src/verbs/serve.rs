//! `serve`: the coordinator's port, its operator socket and its metrics listener, until a stop
//! signal; then a bounded exit.
use super::{Place, STORE_PATIENCE};
use crate::cli::ServeArgs;
use anyhow::{Context, Result};
use fleet_cli::binary;
use fleet_coordinator::{Coordinator, metrics, operator, serve};
use std::path::Path;
use std::sync::Arc;

/// How long a stopping coordinator waits for its store calls still running before it exits.
const EXIT_PATIENCE: std::time::Duration = std::time::Duration::from_secs(1);

pub fn serve_coordinator(place: &Place, args: ServeArgs) -> Result<()> {
    // Two heartbeats fit in a lease, so one lost beat never loses a node.
    if args.heartbeat * 2 >= args.lease {
        anyhow::bail!(
            "--heartbeat {} is at or above half of --lease {}: a node would be lost between two heartbeats; give --lease more than twice the heartbeat",
            fleet_cli::duration::human(args.heartbeat),
            fleet_cli::duration::human(args.lease)
        );
    }
    let data = &place.data;
    let coordinator = Arc::new(Coordinator::open_patiently(
        data,
        &place.store,
        STORE_PATIENCE,
    )?);
    (place.store.mark(data))
        .with_context(|| format!("cannot record the store's kind in {}", data.display()))?;
    let mut config = serve::ServeConfig {
        advertise: String::new(),
        bundles: args.bundles.unwrap_or_else(|| data.join("bundles")),
        heartbeat: args.heartbeat,
        lease: args.lease,
        max_session_validity: args.max_session_validity,
        waiting_timeout: args.waiting_timeout,
        max_connections: (args.max_connections.map(|n| n as usize))
            .unwrap_or_else(default_max_connections),
        shutdown_grace: args.shutdown_grace,
        content_copies: args.content_copies as usize,
        fetch_window: args.fetch_window as usize,
    };
    // Before the runtime: the store's calls block.
    match coordinator.store().tuning_advice() {
        Ok(Some(advice)) => tracing::warn!("{advice}"),
        Ok(None) => {}
        Err(e) => tracing::warn!("cannot read the store's settings: {e}"),
    }
    let runtime = binary::async_runtime_lending(SERVE_BLOCKING_THREADS)?;
    let served = runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(&args.listen)
            .await
            .with_context(|| format!("cannot listen on {}", args.listen))?;
        let local = listener.local_addr()?.to_string();
        let advertise = args.advertise.unwrap_or_else(|| local.clone());
        config.advertise = advertise.clone();
        tracing::info!(listen = %local, key = %coordinator.public_key_text(), data = %data.display(), store = %coordinator.store().location(), "coordinator serving");
        let metrics = bind_metrics(&args.metrics_listen, args.metrics_auth.as_deref()).await?;
        let socket = operator::bind(data).context("cannot open the operator socket")?;
        let socket = tokio::spawn(operator::listen(socket, coordinator.clone(), Some(advertise)));
        let (stop_metrics, metrics_stop) = tokio::sync::oneshot::channel::<()>();
        if let Some(metrics) = metrics {
            let addr = metrics.local_addr()?;
            tracing::info!(%addr, "serving metrics on http://{addr}/metrics (and /healthz, /readyz)");
            let stopped = async move {
                let _ = metrics_stop.await;
            };
            tokio::spawn(metrics::serve_metrics(coordinator.clone(), metrics, stopped));
        }
        serve::announce(&coordinator, &config).await?;
        println!("listening on {local}");
        let served = serve::serve(coordinator.clone(), listener, config, binary::stop_signal()).await;
        drop(stop_metrics);
        socket.abort();
        let _ = std::fs::remove_file(operator::socket_path(data));
        served.context("the coordinator stopped")
    });
    // Store calls still running get a moment to end, not as long as they take (18 s seen in a
    // rolling restart, past the 10 s its nodes wait for it): what they leave undone is left as a
    // crash leaves it, which the store and the nodes are made for.
    // The store's close (its writer's last batch, the database's connections) is bounded the
    // same way: 5.8 s seen after the runtime was down, in a 30 000-node rolling restart.
    let closing = std::time::Instant::now();
    runtime.shutdown_timeout(EXIT_PATIENCE);
    let runtime_ms = closing.elapsed().as_millis() as u64;
    let (closed, store_closed) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let last = Arc::strong_count(&coordinator) == 1;
        drop(coordinator);
        let _ = closed.send(last);
    });
    let store_closed = store_closed.recv_timeout(EXIT_PATIENCE).unwrap_or(false);
    tracing::info!(
        runtime_ms,
        closing_ms = closing.elapsed().as_millis() as u64,
        store_closed,
        "exiting"
    );
    served
}

/// The diagnostic listener `--metrics-listen` asks for (none for `off`), checked before serving.
async fn bind_metrics(
    listen: &str,
    auth: Option<&Path>,
) -> Result<Option<metrics::MetricsListener>> {
    let auth = auth.map(metrics::BearerToken::from_file).transpose()?;
    if listen == "off" {
        return Ok(None);
    }
    Ok(Some(metrics::MetricsListener::bind(listen, auth).await?))
}

/// The threads `serve` lends to blocking work: the store's calls (a pool's worth at a time)
/// and the file steps of content sends. Tokio's default is 512, and each thread it starts stays
/// while any work comes within its keep-alive, holding its stack and its allocator cache: in a
/// 30 000-node rolling restart a coordinator grew to 237 of them while the runs held back were
/// dispatched, and its RSS with them (BENCHMARKS.md, run 38).
const SERVE_BLOCKING_THREADS: usize = 64;

/// Files this process may open, less a reserve for its store, blobs and logs: one a connection.
fn default_max_connections() -> usize {
    /// Open files kept for what is not a connection.
    const RESERVE: u64 = 256;
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    let open_files = limit.current.unwrap_or(1 << 20);
    open_files.saturating_sub(RESERVE).max(1) as usize
}
