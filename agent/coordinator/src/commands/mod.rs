//! Operator commands as types. Each command is one type carrying what it needs, saying whether
//! it only reads ([`Operation::READ_ONLY`]) and answering itself ([`Operation::apply`]);
//! [`Request`] is every command as it travels on the operator socket, and [`Request::apply`]
//! the one dispatch. Adding a command: its type and `apply` in the file of its area, its line in
//! the list below, its CLI arguments and printing in the binary, its rule in the store if it
//! writes (ARCHITECTURE.md, "Where to add").
mod nodes;
mod releases;
mod runs;
mod tokens;

pub use nodes::{Capacity, Drain, EndNode, Forget, Label, ListNodes};
pub use releases::{
    Releases, RevokeReleaseKey, SetRollout, ShowRollout, StartRollout, TakeRelease, TrustRoot,
    UpdateNode,
};
pub use runs::{Collect, CopyTargetsOf, Status, Stop};
pub use tokens::MintTokens;

use crate::check::CheckNodes;
use crate::runs::{ReplicateRequest, RunRequest};
use crate::tokens::TokenRequest;
use crate::{Coordinator, CoordinatorError};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::future::Future;
use std::sync::Arc;

/// One operator command: what it is answered with, and how a coordinator answers it.
pub trait Operation: Serialize + DeserializeOwned + Into<Request> + Send + 'static {
    type Answer: Serialize + DeserializeOwned + Send + 'static;
    /// Asking twice changes nothing: a read is asked again when the serving coordinator went
    /// away mid-request; a change is not, since it may have been applied.
    const READ_ONLY: bool = false;
    fn apply(
        self,
        at: &Context,
    ) -> impl Future<Output = Result<Self::Answer, CoordinatorError>> + Send;
}

/// Where a command is answered: a coordinator, and its advertised address when it serves.
pub struct Context {
    coordinator: Arc<Coordinator>,
    address: Option<String>,
}

impl Context {
    pub fn new(coordinator: Arc<Coordinator>, address: Option<String>) -> Context {
        Context {
            coordinator,
            address,
        }
    }

    pub fn coordinator(&self) -> &Arc<Coordinator> {
        &self.coordinator
    }

    /// Whether a coordinator serves here (not the CLI on the store alone).
    pub fn serving(&self) -> bool {
        self.address.is_some()
    }

    /// Store work, on the blocking pool: a command that writes and syncs the store never
    /// stalls the sessions served on the async thread.
    pub async fn on_store<T: Send + 'static>(
        &self,
        work: impl FnOnce(&Coordinator, Option<&str>) -> Result<T, CoordinatorError> + Send + 'static,
    ) -> Result<T, CoordinatorError> {
        let (coordinator, address) = (self.coordinator.clone(), self.address.clone());
        fleet_cli::blocking::off_thread(move || work(&coordinator, address.as_deref())).await
    }
}

/// The commands, each once: the wire form, its conversions and the one dispatch.
macro_rules! commands {
    ($($verb:ident($command:ty)),* $(,)?) => {
        /// Every operator command, as it travels on the operator socket.
        // One request per operator command: boxing the run request would save nothing worth its noise.
        #[allow(clippy::large_enum_variant)]
        #[derive(Debug, Clone, Serialize, Deserialize)]
        #[serde(tag = "op", content = "args", rename_all = "snake_case")]
        pub enum Request {
            $($verb($command)),*
        }

        $(impl From<$command> for Request {
            fn from(command: $command) -> Request {
                Request::$verb(command)
            }
        })*

        impl Request {
            /// Whether asking twice changes nothing.
            pub fn is_read_only(&self) -> bool {
                match self {
                    $(Request::$verb(_) => <$command as Operation>::READ_ONLY),*
                }
            }

            /// Answers the command; the answer travels as JSON, which the caller reads as the
            /// command's own answer type.
            pub async fn apply(self, at: &Context) -> Result<serde_json::Value, CoordinatorError> {
                match self {
                    $(Request::$verb(command) => answer(command.apply(at).await?)),*
                }
            }
        }
    };
}

commands! {
    Token(TokenRequest),
    Tokens(MintTokens),
    Nodes(ListNodes),
    Run(RunRequest),
    Status(Status),
    Collect(Collect),
    Stop(Stop),
    Replicate(ReplicateRequest),
    Check(CheckNodes),
    Drain(Drain),
    Capacity(Capacity),
    Label(Label),
    End(EndNode),
    Forget(Forget),
    TrustRoot(TrustRoot),
    RevokeReleaseKey(RevokeReleaseKey),
    Releases(Releases),
    Update(UpdateNode),
    StartRollout(StartRollout),
    Rollout(ShowRollout),
    SetRollout(SetRollout),
    AddRelease(TakeRelease),
    CopyTargets(CopyTargetsOf),
}

fn answer<T: Serialize>(value: T) -> Result<serde_json::Value, CoordinatorError> {
    serde_json::to_value(value)
        .map_err(|e| CoordinatorError::Request(format!("an answer did not serialize: {e}")))
}

/// What the operator socket sends back: the command's answer, or the one line saying why not.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Response {
    Ok(serde_json::Value),
    Error(String),
}

/// Answers one request; `address` is the serving coordinator's advertised address, if any.
pub async fn handle(
    coordinator: Arc<Coordinator>,
    address: Option<String>,
    request: Request,
) -> Response {
    match request.apply(&Context::new(coordinator, address)).await {
        Ok(v) => Response::Ok(v),
        Err(e) => Response::Error(e.to_string()),
    }
}
