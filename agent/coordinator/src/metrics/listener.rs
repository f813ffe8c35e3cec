//! The diagnostic listener: `GET /metrics`, `/healthz` and `/readyz` over plain HTTP/1.1, one
//! request a connection. Off loopback it needs a bearer token (`serve --metrics-auth FILE`);
//! `/healthz` and `/readyz` answer without one, as load balancers and watchdogs ask them.
use super::auth::BearerToken;
use super::scrape::{self, Format};
use crate::Coordinator;
use crate::http::{self, Request};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

/// Requests served at once; past it the next connections wait in the listen backlog.
const MAX_REQUESTS: usize = 16;

/// A bound diagnostic listener, with who may read it.
#[derive(Debug)]
pub struct MetricsListener {
    listener: TcpListener,
    auth: Option<BearerToken>,
}

#[derive(Debug, thiserror::Error)]
pub enum MetricsListenError {
    #[error(
        "cannot listen for metrics on {addr}: {cause}; pass --metrics-listen with a free address, or off"
    )]
    Bind { addr: String, cause: std::io::Error },
    #[error(
        "the metrics listener {addr} is reachable off this machine and nothing guards it: give --metrics-auth FILE (a bearer token), or listen on 127.0.0.1"
    )]
    Unguarded { addr: String },
}

impl MetricsListener {
    /// Binds `addr`. An address that is not loopback is refused unless `auth` is given.
    pub async fn bind(
        addr: &str,
        auth: Option<BearerToken>,
    ) -> Result<MetricsListener, MetricsListenError> {
        let bind_error = |cause| MetricsListenError::Bind {
            addr: addr.to_string(),
            cause,
        };
        let resolved: Vec<SocketAddr> = tokio::net::lookup_host(addr)
            .await
            .map_err(bind_error)?
            .collect();
        if auth.is_none() && !resolved.iter().all(|a| a.ip().is_loopback()) {
            return Err(MetricsListenError::Unguarded {
                addr: addr.to_string(),
            });
        }
        let listener = TcpListener::bind(&resolved[..]).await.map_err(bind_error)?;
        Ok(MetricsListener { listener, auth })
    }

    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }
}

/// Serves the diagnostic endpoints until `shutdown` resolves.
pub async fn serve_metrics(
    coordinator: Arc<Coordinator>,
    listener: MetricsListener,
    shutdown: impl Future<Output = ()>,
) {
    let MetricsListener { listener, auth } = listener;
    let auth = Arc::new(auth);
    let places = Arc::new(Semaphore::new(MAX_REQUESTS));
    tokio::pin!(shutdown);
    loop {
        let place = tokio::select! {
            _ = &mut shutdown => return,
            place = places.clone().acquire_owned() => place,
        };
        let Ok(place) = place else { return };
        let stream = tokio::select! {
            _ = &mut shutdown => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!(error = %e, "the metrics listener's accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let (coordinator, auth) = (coordinator.clone(), auth.clone());
        tokio::spawn(async move {
            let _place = place;
            if let Err(e) = answer(&coordinator, auth.as_ref().as_ref(), stream).await {
                tracing::debug!(error = %e, "a metrics client went away");
            }
        });
    }
}

/// What a request asks for, by its method and path (the query is ignored).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Metrics,
    Health,
    Ready,
    NotFound,
    NotAllowed,
}

fn route(request: &Request) -> Route {
    let path = request.path.split('?').next().unwrap_or_default();
    let route = match path {
        "/metrics" => Route::Metrics,
        "/healthz" => Route::Health,
        "/readyz" => Route::Ready,
        _ => return Route::NotFound,
    };
    match request.method.as_str() {
        "GET" => route,
        _ => Route::NotAllowed,
    }
}

async fn answer(
    coordinator: &Coordinator,
    auth: Option<&BearerToken>,
    mut stream: TcpStream,
) -> std::io::Result<()> {
    let Some(request) = http::read_request(&mut stream).await else {
        return Ok(());
    };
    let text = [("content-type", "text/plain; charset=utf-8")];
    match route(&request) {
        Route::Health => http::respond_with(&mut stream, "200 OK", &text, b"ok\n").await,
        Route::Ready => {
            let (status, body) = readiness(coordinator).await;
            http::respond_with(&mut stream, status, &text, body.as_bytes()).await
        }
        Route::Metrics if !auth.is_none_or(|a| a.admits(request.header("authorization"))) => {
            let headers = [text[0], ("www-authenticate", "Bearer")];
            let body =
                b"unauthorized: send the token of --metrics-auth as Authorization: Bearer TOKEN\n";
            http::respond_with(&mut stream, "401 Unauthorized", &headers, body).await
        }
        Route::Metrics => {
            let format = Format::for_accept(request.header("accept"));
            match scrape::exposition(coordinator, format).await {
                Ok(body) => {
                    let headers = [("content-type", format.content_type())];
                    http::respond_with(&mut stream, "200 OK", &headers, body.as_bytes()).await
                }
                Err(e) => {
                    let body = format!("the store cannot be read: {e}\n");
                    http::respond_with(
                        &mut stream,
                        "503 Service Unavailable",
                        &text,
                        body.as_bytes(),
                    )
                    .await
                }
            }
        }
        Route::NotFound => {
            let body = b"not found: this listener serves /metrics, /healthz and /readyz\n";
            http::respond_with(&mut stream, "404 Not Found", &text, body).await
        }
        Route::NotAllowed => {
            let headers = [text[0], ("allow", "GET")];
            http::respond_with(
                &mut stream,
                "405 Method Not Allowed",
                &headers,
                b"only GET\n",
            )
            .await
        }
    }
}

/// Ready when the store answers a read and `serve` takes sessions; otherwise 503 and why.
async fn readiness(coordinator: &Coordinator) -> (&'static str, String) {
    if !coordinator.sessions().accepting() {
        let why = "not ready: the coordinator does not take sessions now (starting or stopping)\n";
        return ("503 Service Unavailable", why.into());
    }
    let read = coordinator
        .with_store(|store| store.read(|tx| tx.coordinators().map(drop)))
        .await;
    match read {
        Ok(()) => ("200 OK", "ready\n".into()),
        Err(e) => (
            "503 Service Unavailable",
            format!("not ready: the store does not answer: {e}\n"),
        ),
    }
}
