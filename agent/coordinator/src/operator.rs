//! Operator requests (`token`, `nodes`, ...) while `serve` holds the store's lock: the serving
//! coordinator answers them on a unix socket in its data directory; without one, the CLI opens
//! the store itself. Both paths run [`handle`].
use crate::runs::{Collected, Replicated, RunView, SetView};
use crate::{Coordinator, CoordinatorError, NodeView, TokenRequest};
use fleet_proto::joinfile::JoinFile;
use fleet_proto::protocol::NodeEnd;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

pub const SOCKET_FILE: &str = "operator.sock";

// One request per operator command: boxing the run request would save nothing worth its noise.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    Token(TokenRequest),
    /// `count` join files of the same request, minted in one transaction; answered as a list.
    Tokens {
        request: TokenRequest,
        count: usize,
    },
    Nodes {
        #[serde(default)]
        filter: crate::NodeFilter,
    },
    Run(super::runs::RunRequest),
    Status {
        set: Option<String>,
        run: Option<String>,
    },
    Collect {
        run: String,
        path: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max_bytes: Option<u64>,
    },
    Stop {
        run: String,
    },
    Replicate(super::runs::ReplicateRequest),
    /// `check --node N|--all`: each node's acceptance checks, through its session.
    Check(crate::check::CheckNodes),
    /// `drain --node N [--undrain]`.
    Drain {
        node: String,
        undrain: bool,
    },
    /// `capacity --node N (--runs K | --reset)`.
    Capacity {
        node: String,
        runs: Option<u32>,
    },
    /// `label --node N K=V... [--remove K]...`.
    Label {
        node: String,
        set: Vec<(String, String)>,
        remove: Vec<String>,
    },
    /// `retire --node N [--discard]` and `revoke --node N`.
    End {
        node: String,
        end: NodeEnd,
        discard: bool,
    },
    /// `forget --node N`.
    Forget {
        node: String,
    },
    /// `release trust --root KEY`.
    TrustRoot {
        root: fleet_proto::pin::PinnedKey,
    },
    /// `release revoke --key KEY`.
    RevokeReleaseKey {
        key: fleet_proto::pin::PinnedKey,
    },
    /// `release list`.
    Releases,
    /// `update --node N [--release SEQUENCE]`.
    Update {
        node: String,
        release: Option<u64>,
    },
    /// `rollout start ...`.
    StartRollout(crate::rollout::RolloutPlan),
    /// `rollout status`.
    Rollout,
    /// `rollout pause`, `resume`, `abort`.
    SetRollout(crate::rollout::RolloutState),
    /// `release add DIR`, its binaries already in the data folder's blob store.
    AddRelease(fleet_proto::release::ReleaseOffer),
    /// Which coordinators `run` pushes its content to while it imports it.
    CopyTargets,
}

impl Request {
    /// Whether asking twice changes nothing.
    pub fn is_read_only(&self) -> bool {
        matches!(
            self,
            Request::Nodes { .. }
                | Request::Status { .. }
                | Request::Releases
                | Request::Rollout
                | Request::CopyTargets
        )
    }
}

/// What a request is answered with: one answer per request, typed, so the CLI reads each as
/// what it is.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Answer {
    Token(Box<JoinFile>),
    Tokens(Vec<JoinFile>),
    Nodes(Vec<NodeView>),
    Run(SetView),
    Status(Vec<RunView>),
    Collected(Collected),
    Stopped,
    Replicated(Replicated),
    Checked(Vec<crate::check::NodeChecks>),
    /// A node as an operator's change (`drain`, `label`, `capacity`, `forget`) left it.
    Node(Box<NodeView>),
    /// A node retired or revoked, and how many of its runs ended lost with it.
    Ended {
        node: Box<NodeView>,
        lost: u64,
    },
    /// The roots a release may be certified by.
    Roots(Vec<fleet_proto::pin::PinnedKey>),
    /// The roots and the revoked release keys.
    Trust(fleet_proto::release::ReleaseTrust),
    Releases(Vec<crate::store::ReleaseRecord>),
    Release(crate::release::TakenRelease),
    Updating(crate::release::UpdateSent),
    Rollout(Option<Box<crate::rollout::Rollout>>),
    /// None where the fleet keeps one copy, or no coordinator serves here.
    CopyTargets(crate::push::CopyTargets),
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Response {
    Ok(Answer),
    Error(String),
}

pub fn socket_path(data: &Path) -> PathBuf {
    data.join(SOCKET_FILE)
}

/// Answers one request; `address` is the serving coordinator's advertised address, if any.
/// Store work runs on the blocking pool, so a `run` that writes and syncs the store never stalls
/// the sessions served on the async thread.
pub async fn handle(
    coordinator: Arc<Coordinator>,
    address: Option<String>,
    request: Request,
) -> Response {
    let result = match request {
        Request::Collect {
            run,
            path,
            max_bytes,
        } => coordinator
            .collect(&run, &path, max_bytes)
            .await
            .map(Answer::Collected),
        Request::Stop { run } => coordinator.stop(&run).await.map(|()| Answer::Stopped),
        Request::Replicate(request) => coordinator
            .replicate(&request)
            .await
            .map(Answer::Replicated),
        Request::Check(request) => coordinator.check_nodes(&request).await.map(Answer::Checked),
        Request::CopyTargets => Ok(Answer::CopyTargets(match address {
            Some(_) => coordinator.copy_targets().await,
            None => crate::push::CopyTargets::default(),
        })),
        Request::Update { node, release } => coordinator
            .update_node(&node, release)
            .await
            .map(Answer::Updating),
        Request::AddRelease(offered) => coordinator
            .take_release(offered, address.is_some())
            .await
            .map(Answer::Release),
        // The signature is checked against the registry first, the content is held by enough
        // coordinators of the fleet, then the set is recorded.
        Request::Run(req) => {
            let checked = async {
                let signed_by = coordinator.check_signature(&req).await?;
                if address.is_some() {
                    coordinator.spread(&req.content()).await?;
                }
                Ok(signed_by)
            };
            match checked.await {
                Ok(signed_by) => tokio::task::spawn_blocking(move || {
                    coordinator.create_runs(&req, signed_by).map(Answer::Run)
                })
                .await
                .unwrap_or_else(|e| {
                    Err(CoordinatorError::Request(format!(
                        "the request did not complete: {e}"
                    )))
                }),
                Err(e) => Err(e),
            }
        }
        request => {
            tokio::task::spawn_blocking(move || answer(&coordinator, address.as_deref(), request))
                .await
                .unwrap_or_else(|e| {
                    Err(CoordinatorError::Request(format!(
                        "the request did not complete: {e}"
                    )))
                })
        }
    };
    match result {
        Ok(v) => Response::Ok(v),
        Err(e) => Response::Error(e.to_string()),
    }
}

/// The requests that only read or write the store.
fn answer(
    coordinator: &Coordinator,
    address: Option<&str>,
    request: Request,
) -> Result<Answer, CoordinatorError> {
    match request {
        Request::Token(req) => {
            (coordinator.mint_token(&req, address)).map(|join| Answer::Token(Box::new(join)))
        }
        Request::Tokens { request, count } => coordinator
            .mint_tokens(&request, count, address)
            .map(Answer::Tokens),
        Request::Nodes { filter } => coordinator.nodes_matching(&filter).map(Answer::Nodes),
        Request::Label { node, set, remove } => coordinator
            .label(&node, &set, &remove)
            .map(|n| Answer::Node(Box::new(n))),
        Request::Capacity { node, runs } => coordinator
            .set_capacity(&node, runs)
            .map(|n| Answer::Node(Box::new(n))),
        Request::Drain { node, undrain } => coordinator
            .drain(&node, undrain)
            .map(|n| Answer::Node(Box::new(n))),
        Request::End { node, end, discard } => {
            coordinator
                .end_node(&node, end, discard)
                .map(|(node, lost)| Answer::Ended {
                    node: Box::new(node),
                    lost,
                })
        }
        Request::Forget { node } => coordinator.forget(&node).map(|n| Answer::Node(Box::new(n))),
        Request::TrustRoot { root } => (coordinator.store().trust_release_root(&root))
            .map(Answer::Roots)
            .map_err(CoordinatorError::from),
        Request::RevokeReleaseKey { key } => (coordinator.store().revoke_release_key(&key))
            .map(Answer::Trust)
            .map_err(CoordinatorError::from),
        Request::StartRollout(plan) => coordinator
            .start_rollout(plan)
            .map(|r| Answer::Rollout(Some(Box::new(r)))),
        Request::Rollout => coordinator
            .rollout()
            .map(|r| Answer::Rollout(r.map(Box::new))),
        Request::SetRollout(state) => coordinator
            .set_rollout(state)
            .map(|r| Answer::Rollout(Some(Box::new(r)))),
        Request::Releases => (coordinator.store().releases())
            .map(Answer::Releases)
            .map_err(CoordinatorError::from),
        Request::Status { set, run } => coordinator
            .status(set.as_deref(), run.as_deref())
            .map(Answer::Status),
        Request::Collect { .. }
        | Request::Stop { .. }
        | Request::Replicate(_)
        | Request::Check(_)
        | Request::AddRelease(_)
        | Request::Update { .. }
        | Request::CopyTargets
        | Request::Run(_) => {
            unreachable!(
                "run, collect, stop, replicate, check and copy targets go beyond the store; `handle` answers them"
            )
        }
    }
}

/// Binds the operator socket; done before the coordinator says it is listening, so operator
/// commands never race the socket.
pub fn bind(data: &Path) -> std::io::Result<tokio::net::UnixListener> {
    let path = socket_path(data);
    // We hold the store's lock, so a socket left here is from a coordinator that died.
    let _ = std::fs::remove_file(&path);
    let listener = tokio::net::UnixListener::bind(&path)?;
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    Ok(listener)
}

/// Serves operator requests, one JSON line each way, until the task is dropped.
pub async fn listen(
    listener: tokio::net::UnixListener,
    coordinator: Arc<Coordinator>,
    address: Option<String>,
) -> std::io::Result<()> {
    // Bound early so no command races the socket, but answered only once this coordinator has
    // recorded itself in the store: a run it takes must be findable by every other coordinator.
    while !coordinator.sessions().accepting() {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    loop {
        let (stream, _) = listener.accept().await?;
        let (coordinator, address) = (coordinator.clone(), address.clone());
        tokio::spawn(async move {
            let (read, mut write) = stream.into_split();
            let mut line = String::new();
            if BufReader::new(read).read_line(&mut line).await.is_err() {
                return;
            }
            let response = match serde_json::from_str::<Request>(&line) {
                Ok(request) => handle(coordinator, address, request).await,
                Err(e) => Response::Error(format!("a malformed operator request: {e}")),
            };
            // Cannot fail: answers are plain data with string keys, which always serialize.
            let mut out = serde_json::to_vec(&response).expect("responses serialize");
            out.push(b'\n');
            let _ = write.write_all(&out).await;
        });
    }
}

/// Sends a request to a serving coordinator; None when none is serving from `data`.
/// Whether a coordinator serves `data` now (its operator socket answers a connection).
pub fn served(data: &Path) -> bool {
    std::os::unix::net::UnixStream::connect(socket_path(data)).is_ok()
}

pub fn call(data: &Path, request: &Request) -> Option<std::io::Result<Response>> {
    use std::io::{BufRead, Write};
    let stream = std::os::unix::net::UnixStream::connect(socket_path(data)).ok()?;
    let exchange = || {
        // Cannot fail: requests are plain data with string keys, which always serialize.
        let mut line = serde_json::to_vec(request).expect("requests serialize");
        line.push(b'\n');
        (&stream).write_all(&line)?;
        let mut answer = String::new();
        std::io::BufReader::new(&stream).read_line(&mut answer)?;
        serde_json::from_str(&answer).map_err(std::io::Error::other)
    };
    Some(exchange())
}
