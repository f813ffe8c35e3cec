//! The diagnostic listener: `GET /metrics`, `/healthz`, `/readyz` and the status page over plain
//! HTTP/1.1, one request a connection (a page's event stream holds its connection). Off loopback
//! the metrics and the page need a bearer token (`serve --metrics-auth FILE`); `/healthz` and
//! `/readyz` answer without one, as load balancers and watchdogs ask them.
use super::auth::BearerToken;
use super::page::{self, Page, PageError, Rendered};
use super::scrape::{self, Format};
use crate::Coordinator;
use crate::http::{self, Request};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

/// Connections served at once; past it the next ones wait in the listen backlog.
const MAX_CONNECTIONS: usize = 128;
/// Open pages (event streams) at once, so that scrapes always find a place; past it a page's
/// stream is answered 503.
const MAX_STREAMS: usize = 64;
/// How often an open page gets its body again, at the most.
const REFRESH: std::time::Duration = std::time::Duration::from_secs(1);

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

/// Serves the diagnostic endpoints until `shutdown` resolves; open pages' streams end with it.
pub async fn serve_metrics(
    coordinator: Arc<Coordinator>,
    listener: MetricsListener,
    shutdown: impl Future<Output = ()>,
) {
    let MetricsListener { listener, auth } = listener;
    let shared = Arc::new(Shared {
        coordinator,
        auth,
        streams: Arc::new(Semaphore::new(MAX_STREAMS)),
        stopping: tokio::sync::watch::channel(false).0,
    });
    let places = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    tokio::pin!(shutdown);
    loop {
        let place = tokio::select! {
            _ = &mut shutdown => break,
            place = places.clone().acquire_owned() => place,
        };
        let Ok(place) = place else { break };
        let stream = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!(error = %e, "the metrics listener's accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            let _place = place;
            if let Err(e) = answer(&shared, stream).await {
                tracing::debug!(error = %e, "a metrics client went away");
            }
        });
    }
    let _ = shared.stopping.send(true);
}

/// What every request of the listener reads.
struct Shared {
    coordinator: Arc<Coordinator>,
    auth: Option<BearerToken>,
    streams: Arc<Semaphore>,
    stopping: tokio::sync::watch::Sender<bool>,
}

/// What a request asks for, by its method and path.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Route {
    Metrics,
    Health,
    Ready,
    Page(Page),
    /// The event stream of the page named by its `view` parameter.
    Events(Page),
    Refused(PageError),
    NotAllowed,
}

fn route(request: &Request) -> Route {
    if request.method != "GET" {
        return Route::NotAllowed;
    }
    let path = request.path.split('?').next().unwrap_or_default();
    let parsed = match path {
        "/metrics" => return Route::Metrics,
        "/healthz" => return Route::Health,
        "/readyz" => return Route::Ready,
        "/events" => events_view(&request.path).map(Route::Events),
        _ => Page::parse(&request.path).map(Route::Page),
    };
    parsed.unwrap_or_else(Route::Refused)
}

/// The page an event stream is for: its `view` parameter, a page's path and query.
fn events_view(target: &str) -> Result<Page, PageError> {
    let query = target.split_once('?').map_or("", |(_, q)| q);
    let view = (query.split('&'))
        .find_map(|p| p.strip_prefix("view="))
        .ok_or_else(|| PageError::BadQuery("an event stream needs view=PAGE".into()))?;
    let view = page::decode_component(view)?;
    Page::parse(&view)
}

const TEXT: (&str, &str) = ("content-type", "text/plain; charset=utf-8");

async fn answer(shared: &Shared, mut stream: TcpStream) -> std::io::Result<()> {
    let Some(request) = http::read_request(&mut stream).await else {
        return Ok(());
    };
    let coordinator = &shared.coordinator;
    let route = route(&request);
    let open = matches!(route, Route::Health | Route::Ready | Route::NotAllowed);
    if !open
        && !shared
            .auth
            .as_ref()
            .is_none_or(|a| a.admits(request.header("authorization")))
    {
        let headers = [TEXT, ("www-authenticate", "Bearer")];
        let body =
            b"unauthorized: send the token of --metrics-auth as Authorization: Bearer TOKEN\n";
        return http::respond_with(&mut stream, "401 Unauthorized", &headers, body).await;
    }
    match route {
        Route::Health => http::respond_with(&mut stream, "200 OK", &[TEXT], b"ok\n").await,
        Route::Ready => {
            let (status, body) = readiness(coordinator).await;
            http::respond_with(&mut stream, status, &[TEXT], body.as_bytes()).await
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
                    let status = "503 Service Unavailable";
                    http::respond_with(&mut stream, status, &[TEXT], body.as_bytes()).await
                }
            }
        }
        Route::Page(page) => match render(coordinator, &page).await {
            Ok(rendered) => {
                let view = request.path.clone();
                let html = page::document(&page, &view, &rendered);
                let headers = [("content-type", "text/html; charset=utf-8")];
                http::respond_with(&mut stream, "200 OK", &headers, html.as_bytes()).await
            }
            Err(e) => refuse(&mut stream, e).await,
        },
        Route::Events(page) => {
            let Ok(_stream_place) = shared.streams.clone().try_acquire_owned() else {
                let body = b"too many open pages: close one, or try again\n";
                let status = "503 Service Unavailable";
                return http::respond_with(&mut stream, status, &[TEXT], body).await;
            };
            events(coordinator, &page, stream, shared.stopping.subscribe()).await
        }
        Route::Refused(e) => refuse(&mut stream, e).await,
        Route::NotAllowed => {
            let headers = [TEXT, ("allow", "GET")];
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

async fn refuse(stream: &mut TcpStream, error: PageError) -> std::io::Result<()> {
    let (status, line) = match error {
        PageError::NotFound(line) => ("404 Not Found", line),
        PageError::BadQuery(line) => ("400 Bad Request", line),
        PageError::Store(line) => ("503 Service Unavailable", line),
    };
    http::respond_with(stream, status, &[TEXT], format!("{line}\n").as_bytes()).await
}

/// The page's body, rendered on the blocking pool (it reads the store).
async fn render(coordinator: &Arc<Coordinator>, page: &Page) -> Result<Rendered, PageError> {
    let (coordinator, page) = (coordinator.clone(), page.clone());
    tokio::task::spawn_blocking(move || {
        let recorder = coordinator.recorder();
        let context = page::Context {
            heartbeat_ms: recorder.heartbeat_ms(),
            ended_per_minute: recorder.ended_per_minute(fleet_proto::clock::now_ms()),
        };
        page::render_main(&coordinator, &page, &context)
    })
    .await
    .unwrap_or_else(|e| Err(PageError::Store(format!("rendering failed: {e}"))))
}

/// A page's event stream: its body again every [`REFRESH`] (ten times its render time when that
/// is longer), until the page closes or the listener stops.
async fn events(
    coordinator: &Arc<Coordinator>,
    page: &Page,
    mut stream: TcpStream,
    mut stopping: tokio::sync::watch::Receiver<bool>,
) -> std::io::Result<()> {
    use tokio::io::AsyncWriteExt;
    let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\nconnection: close\r\n\r\nretry: 2000\n\n";
    stream.write_all(head.as_bytes()).await?;
    let mut pause = std::time::Duration::ZERO;
    loop {
        tokio::select! {
            _ = stopping.changed() => return stream.shutdown().await,
            _ = tokio::time::sleep(pause) => {}
        }
        let began = tokio::time::Instant::now();
        let message = match render(coordinator, page).await {
            Ok(rendered) => page::event_message(&rendered.main),
            // A page gone meanwhile (a pruned set) says so where it stood.
            Err(e) => page::event_message(&format!("<p>{}</p>", page::escape(&format!("{e:?}")))),
        };
        stream.write_all(message.as_bytes()).await?;
        // A large fleet's page takes longer to render: an open page takes at most a tenth of a core.
        pause = REFRESH.max(began.elapsed() * 10);
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
