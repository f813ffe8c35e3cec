//! The agent's life: prepare the state folder, load or make the node key, join once (or resume
//! the membership), forget the join secrets, then keep a session open.
use crate::dial::{Coordinators, DialError};
use crate::ended::{self, EndedError};
use crate::facts::FactsSource;
use crate::identity::{self, IdentityError, Membership};
use crate::join::{self, JoinError};
use crate::node::Node;
use crate::runtime::{ProcessRuntime, Routed};
use crate::session::{self, SessionSettings};
use fleet_cli::blocking::off_thread;
use fleet_proto::clock::now_ms;
use fleet_proto::joinfile::{self, JoinFile, JoinFileError};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub const DEFAULT_STATE: &str = "/var/lib/octomy-agent";
pub const DEFAULT_CLOUD_ROOT: &str = "/var/lib/cloud";
pub use fleet_proto::unit::INSTALL_DIR as DEFAULT_INSTALL_DIR;

#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub join_file: PathBuf,
    pub state: PathBuf,
    pub cloud_root: PathBuf,
    pub facts: FactsSource,
    pub session: SessionSettings,
    /// The supervisor binary; None means the one shipped beside this executable.
    pub supervisor: Option<PathBuf>,
    /// The Docker engine images run on (the local socket by default).
    pub docker: crate::runtime::docker::EngineAddress,
    /// Where replicated artifacts go; None refuses artifact commands.
    pub artifact_root: Option<PathBuf>,
    /// Where its releases are installed.
    pub install_dir: PathBuf,
    /// How long a new release's trial lasts.
    pub update_trial: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Identity(#[from] IdentityError),
    #[error(transparent)]
    JoinFile(#[from] JoinFileError),
    #[error(transparent)]
    Join(#[from] JoinError),
    #[error(transparent)]
    Session(#[from] DialError),
    #[error("joined, but cannot remove a secret copy: {0}")]
    Cleanup(std::io::Error),
    #[error(transparent)]
    State(#[from] crate::state::StateError),
    #[error(transparent)]
    Runtime(#[from] crate::runtime::RuntimeError),
    /// The fleet's operator retired or revoked this node: the agent's last line.
    #[error(transparent)]
    Ended(#[from] EndedError),
}

/// Runs the agent until the fleet's operator ends its node ([`AgentError::Ended`]) or a fatal
/// error; it never returns otherwise.
pub async fn run(config: AgentConfig) -> Result<std::convert::Infallible, AgentError> {
    let started = Instant::now();
    identity::prepare_state_dir(&config.state)?;
    if let Some(ended) = ended::noted(&config.state) {
        return Err(ended.into());
    }
    let identity = Arc::new(identity::load_or_create(&config.state)?);
    let membership = match identity::load_membership(&config.state)? {
        Some(m) => {
            tracing::info!(node_id = %m.node_id, address = %m.address, "resuming the membership; no join needed");
            m
        }
        None => {
            let file = JoinFile::read(&config.join_file)?;
            tracing::info!(address = %file.address, join_file = %config.join_file.display(), "joining");
            let node_id = join::join(&identity, &file, config.session.retry_base).await?;
            let membership = Membership {
                node_id,
                address: file.address.clone(),
                alternates: file.alternates.clone(),
                coordinator_key: file.pin(),
                name: file.name.clone(),
                joined_at_ms: now_ms(),
                release_roots: file.release_roots.clone(),
            };
            // Recorded before the secrets go: a crash in between retries the join, which the
            // coordinator answers again for this key.
            identity::save_membership(&config.state, &membership)?;
            membership
        }
    };
    let removed = joinfile::remove_secrets(&config.join_file, &config.cloud_root)
        .map_err(AgentError::Cleanup)?;
    for path in &removed {
        tracing::info!(path = %path.display(), "removed a copy of the join secret");
    }
    tracing::info!(
        node_id = %membership.node_id,
        elapsed_ms = started.elapsed().as_millis() as u64,
        "Joined"
    );
    // Opened after the join: the join needs none of it, and a fresh machine reports sooner.
    // Blocking work (the store, the engine's first answer, re-adoption) off the async thread.
    let node = {
        let (config, node_id) = (config.clone(), membership.node_id.clone());
        tokio::task::spawn_blocking(move || open_node(&config, &node_id))
            .await
            // Cannot fail: the task returns its errors; it panics only on a bug, which should stop the agent.
            .expect("opening the node does not panic")?
    };
    let install = crate::update::Install::new(&config.install_dir);
    let releases = crate::update::Releases {
        started_as: install.running(),
        install,
        state: config.state.clone(),
        roots: membership.release_roots.clone(),
        trial: config.update_trial,
    };
    // An update a restart cut into is finished first (a revert execs the restored agent here).
    let at_start = releases.at_start().unwrap_or_else(|e| {
        tracing::warn!("cannot read the release record: {e}");
        crate::update::AtStart::Normal
    });
    let facts = crate::facts::FactsSource {
        releases: Some(releases.clone()),
        ..config.facts.clone()
    };
    let coordinators = Coordinators::new(membership.addresses());
    let content = crate::content::ContentLink {
        address: coordinators.clone(),
        node_id: membership.node_id.clone(),
        identity: identity.clone(),
        pinned: membership.coordinator_key.as_bytes().to_vec(),
        validity: config.session.validity,
        blobs: crate::node::content_blobs(&config.state),
    };
    let node = Arc::new(
        node.with_content(
            content,
            config.artifact_root.as_deref(),
            config.facts.link.clone(),
        )
        .with_releases(Some(releases.clone())),
    );
    if let crate::update::AtStart::OnTrial {
        from,
        to,
        deadline_ms,
    } = at_start
    {
        tracing::info!(from, to, "running release {to} on trial");
        let node = node.clone();
        let began = tokio::time::Instant::now();
        tokio::spawn(async move {
            let in_session = || node.in_session();
            releases
                .trial(from, to, deadline_ms, began, &in_session)
                .await;
            node.tell_facts_changed();
        });
    }
    // Starts a crash cut off before their launch: those that cannot be completed fail before
    // the session opens; the others are completed beside it (a pull may take long).
    let launches = {
        let node = node.clone();
        off_thread(move || node.unlaunched()).await?
    };
    for launch in launches {
        let node = node.clone();
        tokio::spawn(async move {
            let run_id = launch.start.run_id.clone();
            if let Err(e) = node.complete(launch).await {
                tracing::warn!(%run_id, "cannot complete a start a crash cut off: {e}");
            }
        });
    }
    // Coordinators a session named are kept, so a restarted agent knows the whole fleet too.
    let remember = |known: Vec<String>| {
        let mut updated = membership.clone();
        updated.alternates = known
            .into_iter()
            .filter(|a| *a != updated.address)
            .collect();
        if let Err(e) = identity::save_membership(&config.state, &updated) {
            tracing::warn!("cannot record the fleet's coordinators: {e}");
        }
    };
    let end = session::run(
        &identity,
        &membership,
        &coordinators,
        &remember,
        &facts,
        &node,
        &config.session,
    )
    .await?;
    tracing::warn!(end = end.as_str(), "the fleet's operator ended this node");
    let state = config.state.clone();
    let ended = tokio::task::spawn_blocking(move || ended::carry_out(end, &state, &node))
        .await
        // Cannot fail: the task returns its outcome; it panics only on a bug, which should stop the agent.
        .expect("carrying out the node's end does not panic");
    Err(ended.into())
}

/// Opens the node's store and runtime, and re-adopts every run it knows: results missed while
/// the agent was down are spooled now, a run whose supervisor died is spooled `lost`, once.
fn open_node(config: &AgentConfig, node_id: &fleet_proto::NodeId) -> Result<Node, AgentError> {
    let run_store = config.facts.run_store.clone();
    let process = match &config.supervisor {
        Some(path) => ProcessRuntime::new(path, run_store),
        None => ProcessRuntime::beside_current_exe(run_store)?,
    };
    // Containers carry the node's id, so agents sharing an engine keep to their own.
    let runtime = Routed::new(
        process,
        config.docker.clone(),
        &config.state.join("docker"),
        node_id.as_str(),
    );
    let node = Node::open(&config.state, Arc::new(runtime))?
        .with_run_store(config.facts.run_store.clone());
    let report = node.sync_runs()?;
    if !report.events.is_empty() {
        tracing::info!(
            events = report.events.len(),
            "re-adopted the runs; spooled what was missed"
        );
    }
    Ok(node)
}

/// How long the agent waits before its first retry; doubles up to [`crate::backoff::CAP`].
pub const DEFAULT_RETRY_BASE: Duration = Duration::from_millis(250);
