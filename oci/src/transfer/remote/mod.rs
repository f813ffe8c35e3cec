//! A thin distribution (registry API v2) client: one per registry host, with TLS, auth and bounded retries.
//!
//! It keeps to what the transfers need (HEAD/GET/PUT of manifests and blobs, upload sessions,
//! mounts) so the bytes on the wire are exactly the stored bytes, and owns its `reqwest` client so a
//! client identity and extra roots can be attached.
pub mod blobs;
pub mod challenge;
pub mod error;
pub mod manifests;
pub mod verify;

use crate::transfer::auth::Credential;
use crate::transfer::tls::{TlsOptions, TlsSetup};
use crate::types::text::one_line;
use challenge::Challenge;
pub use error::RemoteError;
use reqwest::{Method, RequestBuilder, Response, StatusCode, header};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How many times a request that met 429 or 5xx is sent before giving up.
pub const MAX_TRIES: u32 = 5;
/// The first retry waits this long; each next one twice as long.
const FIRST_BACKOFF: Duration = Duration::from_millis(200);
/// No wait (even one a registry asks for with Retry-After) is longer than this.
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// A registry, shared by every transfer to or from it.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

struct Inner {
    http: reqwest::Client,
    host: String,
    base: String,
    credential: Option<Credential>,
    tls: Option<TlsSetup>,
    auth: Mutex<AuthState>,
    resolved: tokio::sync::OnceCell<()>,
}

#[derive(Default)]
struct AuthState {
    /// The registry asked for Basic auth: send it on every request.
    basic: bool,
    /// Bearer tokens by scope key.
    tokens: HashMap<String, String>,
}

/// What a request needs access to, for bearer token scopes and error messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scope {
    pub repo: String,
    pub push: bool,
    /// A mount's source repository, which needs pull access too.
    pub mount_from: Option<String>,
}

impl Scope {
    pub fn pull(repo: &str) -> Scope {
        Scope {
            repo: repo.to_string(),
            push: false,
            mount_from: None,
        }
    }

    pub fn push(repo: &str) -> Scope {
        Scope {
            repo: repo.to_string(),
            push: true,
            mount_from: None,
        }
    }

    fn scopes(&self) -> Vec<String> {
        let actions = if self.push { "pull,push" } else { "pull" };
        let mut v = vec![format!("repository:{}:{actions}", self.repo)];
        if let Some(from) = &self.mount_from {
            v.push(format!("repository:{from}:pull"));
        }
        v
    }

    fn key(&self) -> String {
        self.scopes().join(" ")
    }

    fn action(&self) -> &'static str {
        if self.push { "push" } else { "pull" }
    }
}

impl Client {
    /// A client for `host` (`HOST[:PORT]`); nothing is sent until the first request.
    pub fn new(
        host: &str,
        tls: &TlsOptions,
        credential: Option<Credential>,
    ) -> Result<Client, RemoteError> {
        // reqwest wants a TLS configuration even for plain HTTP (a token realm may be https).
        let config = tls.setup(host)?;
        let (scheme, setup) = if tls.plain_http {
            ("http", None)
        } else {
            ("https", Some(config.clone()))
        };
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(15))
            .pool_idle_timeout(Duration::from_secs(30))
            .user_agent(concat!("oci/", env!("CARGO_PKG_VERSION")))
            .use_preconfigured_tls((*config.config).clone())
            .build()
            .map_err(|e| RemoteError::Tls {
                host: host.to_string(),
                detail: e.to_string(),
            })?;
        Ok(Client {
            inner: Arc::new(Inner {
                http,
                host: host.to_string(),
                base: format!("{scheme}://{host}"),
                credential,
                tls: setup,
                auth: Mutex::new(AuthState::default()),
                resolved: tokio::sync::OnceCell::new(),
            }),
        })
    }

    /// `HOST[:PORT]`.
    pub fn host(&self) -> &str {
        &self.inner.host
    }

    /// Whether another client talks to the same registry with the same identity (so it can mount).
    pub fn same_registry(&self, other: &Client) -> bool {
        self.inner.base == other.inner.base && self.inner.credential == other.inner.credential
    }

    /// An absolute URL for a path (`/v2/...`) or for a Location header (relative or absolute).
    pub fn url(&self, path_or_url: &str) -> String {
        if path_or_url.starts_with("http://") || path_or_url.starts_with("https://") {
            path_or_url.to_string()
        } else {
            format!("{}{path_or_url}", self.inner.base)
        }
    }

    /// Resolves the host once, so a name that does not resolve gets its own message.
    async fn resolve(&self) -> Result<(), RemoteError> {
        self.inner
            .resolved
            .get_or_try_init(|| async {
                let host = &self.inner.host;
                let with_port = match host.rsplit_once(':') {
                    Some((_, p)) if !p.contains(']') && p.parse::<u16>().is_ok() => host.clone(),
                    _ => format!("{host}:{}", if self.inner.tls.is_some() { 443 } else { 80 }),
                };
                match tokio::net::lookup_host(with_port)
                    .await
                    .map(|mut a| a.next())
                {
                    Ok(Some(_)) => Ok(()),
                    _ => Err(RemoteError::Resolve { host: host.clone() }),
                }
            })
            .await
            .map(|_| ())
    }

    fn authorization(&self, scope: &Scope) -> Option<String> {
        let auth = self
            .inner
            .auth
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(token) = auth.tokens.get(&scope.key()) {
            return Some(token.clone());
        }
        if auth.basic {
            return self.inner.credential.as_ref().map(Credential::basic);
        }
        None
    }

    /// Sends a request built afresh for each try: it gets auth on a 401 and retries 429 and 5xx.
    pub async fn send(
        &self,
        scope: &Scope,
        method: Method,
        url: &str,
        build: impl Fn(RequestBuilder) -> RequestBuilder,
    ) -> Result<Response, RemoteError> {
        let mut tries = 0;
        let mut authorized = false;
        loop {
            tries += 1;
            let rb = build(self.inner.http.request(method.clone(), url));
            let resp = self.send_once(scope, rb).await;
            let resp = match resp {
                Err(RemoteError::Network { .. }) if tries < MAX_TRIES => {
                    tokio::time::sleep(backoff(tries, None)).await;
                    continue;
                }
                other => other?,
            };
            let status = resp.status();
            if status == StatusCode::UNAUTHORIZED {
                if authorized {
                    return Err(self.refusal(&resp, scope));
                }
                authorized = true;
                self.authorize(&resp, scope).await?;
                continue;
            }
            if retryable(status) {
                if tries < MAX_TRIES {
                    tokio::time::sleep(backoff(tries, retry_after(&resp))).await;
                    continue;
                }
                return Err(RemoteError::Exhausted {
                    host: self.inner.host.clone(),
                    status: status.as_u16(),
                    method: method.to_string(),
                    path: path_of(url),
                    tries,
                });
            }
            return Ok(resp);
        }
    }

    /// Sends one request as built (a streamed body cannot be replayed), with the auth already known.
    pub async fn send_once(
        &self,
        scope: &Scope,
        rb: RequestBuilder,
    ) -> Result<Response, RemoteError> {
        self.resolve().await?;
        let rb = match self.authorization(scope) {
            Some(value) => rb.header(header::AUTHORIZATION, value),
            None => rb,
        };
        rb.send()
            .await
            .map_err(|e| error::classify(&e, &self.inner.host, self.inner.tls.as_ref()))
    }

    /// A request builder on this client (for streamed bodies sent with `send_once`).
    pub fn request(&self, method: Method, url: &str) -> RequestBuilder {
        self.inner.http.request(method, url)
    }

    /// Makes sure the next request for `scope` carries auth (a token fetched beforehand if needed).
    pub async fn prepare(&self, scope: &Scope) -> Result<(), RemoteError> {
        let url = self.url("/v2/");
        let resp = self.send(scope, Method::GET, &url, |rb| rb).await?;
        match resp.status() {
            s if s.is_success() => Ok(()),
            _ => Err(self.status_error(resp, scope, "the registry API").await),
        }
    }

    /// Answers a first 401: Basic with the credential, or a (fresh) Bearer token for the scope.
    async fn authorize(&self, resp: &Response, scope: &Scope) -> Result<(), RemoteError> {
        match challenge_of(resp) {
            Some(Challenge::Basic) if self.inner.credential.is_some() => {
                self.inner
                    .auth
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .basic = true;
                Ok(())
            }
            Some(Challenge::Bearer {
                realm,
                service,
                scope: asked,
                ..
            }) => {
                let token = self
                    .fetch_token(&realm, service.as_deref(), asked.as_deref(), scope)
                    .await?;
                let mut auth = self
                    .inner
                    .auth
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                auth.tokens.insert(scope.key(), format!("Bearer {token}"));
                Ok(())
            }
            _ => Err(self.refusal(resp, scope)),
        }
    }

    /// The error for a 401 that auth did not cure: too little scope, bad credentials, or none.
    fn refusal(&self, resp: &Response, scope: &Scope) -> RemoteError {
        let (host, repo) = (self.inner.host.clone(), scope.repo.clone());
        match challenge_of(resp) {
            Some(Challenge::Bearer { error: Some(e), .. }) if e == "insufficient_scope" => {
                RemoteError::Forbidden {
                    host,
                    repo,
                    action: scope.action(),
                }
            }
            _ if self.inner.credential.is_some() => RemoteError::BadCreds { host, repo },
            _ => RemoteError::NeedCreds { host, repo },
        }
    }

    async fn fetch_token(
        &self,
        realm: &str,
        service: Option<&str>,
        asked: Option<&str>,
        scope: &Scope,
    ) -> Result<String, RemoteError> {
        let mut query: Vec<(&str, String)> = Vec::new();
        if let Some(s) = service {
            query.push(("service", s.to_string()));
        }
        let mut scopes = scope.scopes();
        if let Some(a) = asked.filter(|a| !scopes.iter().any(|s| s == a)) {
            scopes.push(a.to_string());
        }
        query.extend(scopes.into_iter().map(|s| ("scope", s)));
        let mut rb = self.inner.http.get(realm).query(&query);
        if let Some(c) = &self.inner.credential {
            rb = rb.header(header::AUTHORIZATION, c.basic());
        }
        let resp = rb
            .send()
            .await
            .map_err(|e| error::classify(&e, &self.inner.host, self.inner.tls.as_ref()))?;
        let status = resp.status();
        if status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN {
            let (host, repo) = (self.inner.host.clone(), scope.repo.clone());
            return Err(match self.inner.credential {
                Some(_) => RemoteError::BadCreds { host, repo },
                None => RemoteError::NeedCreds { host, repo },
            });
        }
        let bad = |detail: String| RemoteError::BadAnswer {
            host: self.inner.host.clone(),
            method: "GET".into(),
            path: realm.to_string(),
            detail,
        };
        if !status.is_success() {
            return Err(bad(format!("the token service answered {status}")));
        }
        let bytes = resp.bytes().await.map_err(|e| bad(e.to_string()))?;
        let body: serde_json::Value =
            serde_json::from_slice(&bytes).map_err(|e| bad(e.to_string()))?;
        body.get("token")
            .or_else(|| body.get("access_token"))
            .and_then(|t| t.as_str())
            .map(str::to_string)
            .ok_or_else(|| bad("the token service sent no token".into()))
    }

    /// The error for an answer that is not what was asked for; `what` names the thing (for 404).
    pub async fn status_error(&self, resp: Response, scope: &Scope, what: &str) -> RemoteError {
        let host = self.inner.host.clone();
        let status = resp.status();
        let method_path = path_of(resp.url().as_str());
        match status {
            StatusCode::UNAUTHORIZED => self.refusal(&resp, scope),
            StatusCode::FORBIDDEN => RemoteError::Forbidden {
                host,
                repo: scope.repo.clone(),
                action: scope.action(),
            },
            StatusCode::NOT_FOUND => RemoteError::NotFound {
                what: what.to_string(),
            },
            _ => {
                // Go's TLS server answers plain HTTP with a bare HTTP/1.0 400 (its body, which
                // says so, is not read for a HEAD); a registry itself answers HTTP/1.1.
                let bare = resp.version() == reqwest::Version::HTTP_10;
                let detail = error_detail(resp).await;
                if status == StatusCode::BAD_REQUEST
                    && self.inner.tls.is_none()
                    && (bare || detail.contains("HTTP request to an HTTPS server"))
                {
                    return RemoteError::NotPlain { host };
                }
                RemoteError::Unexpected {
                    host,
                    status: status.as_u16(),
                    path: method_path,
                    detail,
                }
            }
        }
    }
}

fn challenge_of(resp: &Response) -> Option<Challenge> {
    resp.headers()
        .get(header::WWW_AUTHENTICATE)
        .and_then(|v| v.to_str().ok())
        .and_then(challenge::parse)
}

/// The registry's JSON error codes and messages (`: CODE message`), or nothing.
pub async fn error_detail(resp: Response) -> String {
    let bytes = resp.bytes().await.unwrap_or_default();
    let body: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
    let errors: Vec<String> = body
        .get("errors")
        .and_then(|e| e.as_array())
        .into_iter()
        .flatten()
        .map(|e| {
            let code = e.get("code").and_then(|c| c.as_str()).unwrap_or("");
            let message = e.get("message").and_then(|m| m.as_str()).unwrap_or("");
            one_line(&format!("{code} {message}"))
        })
        .collect();
    if !errors.is_empty() {
        return format!(": {}", errors.join("; "));
    }
    // Not the registry's JSON: its first line of text, if short (a proxy's or TLS server's answer).
    let text = String::from_utf8_lossy(&bytes);
    match text.split(['\n', '\r']).next().map(one_line) {
        Some(line) if !line.is_empty() && line.len() <= 200 => format!(": {line}"),
        _ => String::new(),
    }
}

/// Whether an answer status is worth another try.
pub fn retryable(status: StatusCode) -> bool {
    status == StatusCode::TOO_MANY_REQUESTS || status.is_server_error()
}

fn retry_after(resp: &Response) -> Option<Duration> {
    let secs: u64 = resp
        .headers()
        .get(header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()?;
    Some(Duration::from_secs(secs))
}

/// The wait before try `tries + 1`: doubling from FIRST_BACKOFF, or what the registry asked, capped.
pub fn backoff(tries: u32, asked: Option<Duration>) -> Duration {
    asked
        .unwrap_or(FIRST_BACKOFF * 2u32.saturating_pow(tries.saturating_sub(1)))
        .min(MAX_BACKOFF)
}

/// The path of a URL, for messages (never credentials: those travel in headers).
fn path_of(url: &str) -> String {
    match url
        .find("://")
        .and_then(|i| url[i + 3..].find('/').map(|j| i + 3 + j))
    {
        Some(i) => {
            let p = &url[i..];
            // Upload URLs carry long opaque state; the path is enough to read.
            p.split('?').next().unwrap_or(p).to_string()
        }
        None => url.to_string(),
    }
}
