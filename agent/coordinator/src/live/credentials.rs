//! Registry credentials for image runs, held in this coordinator's memory only, from `run` until
//! the node takes the run (its start is answered), or until the run can no longer be taken
//! (nobody took it within the waiting timeout, whichever coordinator swept it). Never stored,
//! never logged.
use super::guarded::Guarded;
use fleet_proto::RunId;
use fleet_proto::run::RegistryAuth;
use std::collections::HashMap;
use std::time::{Duration, Instant};

#[derive(Default)]
pub(crate) struct Credentials {
    state: Guarded<Held>,
}

#[derive(Default)]
struct Held {
    /// Set while `serve` runs: how long a run may wait for its node. None: not serving.
    waiting_timeout: Option<Duration>,
    by_run: HashMap<RunId, (RegistryAuth, Instant)>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum CredentialRefusal {
    #[error(
        "--registry-auth needs a serving coordinator: the credential is kept only in its memory until the node takes the run, never in the store; start `fleet-coordinator serve` first"
    )]
    NotServing,
}

impl Credentials {
    /// From now on credentials can be held: `serve` runs, and a run waits at most
    /// `waiting_timeout` for its node.
    pub(crate) fn open(&self, waiting_timeout: Duration) {
        self.state.lock().waiting_timeout = Some(waiting_timeout);
    }

    /// Whether a credential could be held now.
    pub(crate) fn can_hold(&self) -> Result<(), CredentialRefusal> {
        match self.state.lock().waiting_timeout {
            Some(_) => Ok(()),
            None => Err(CredentialRefusal::NotServing),
        }
    }

    /// Holds `auth` for each of `runs` until their node takes them or they can wait no longer.
    pub(crate) fn hold<'a>(
        &self,
        runs: impl IntoIterator<Item = &'a RunId>,
        auth: &RegistryAuth,
    ) -> Result<(), CredentialRefusal> {
        let mut held = self.state.lock();
        let valid = held.waiting_timeout.ok_or(CredentialRefusal::NotServing)?;
        // A margin past the waiting timeout: the sweep that fails such a run runs once a heartbeat.
        let until = Instant::now() + valid + Duration::from_secs(60);
        for run in runs {
            held.by_run.insert(run.clone(), (auth.clone(), until));
        }
        Ok(())
    }

    /// The credential to send in `run`'s start; still held until the start is answered.
    pub(crate) fn for_start(&self, run: &RunId) -> Option<RegistryAuth> {
        self.state
            .lock()
            .by_run
            .get(run)
            .map(|(auth, _)| auth.clone())
    }

    /// Lets go of `run`'s credential: its node took the run, or it was never recorded. True
    /// when it was held.
    pub(crate) fn release(&self, run: &RunId) -> bool {
        self.state.lock().by_run.remove(run).is_some()
    }

    /// Lets go of the credentials of runs that can no longer be taken; how many.
    pub(crate) fn expire(&self) -> usize {
        self.expire_at(Instant::now())
    }

    fn expire_at(&self, now: Instant) -> usize {
        let mut held = self.state.lock();
        let before = held.by_run.len();
        held.by_run.retain(|_, (_, until)| *until > now);
        before - held.by_run.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(id: &str) -> RunId {
        RunId::parse(id).unwrap()
    }

    fn auth() -> RegistryAuth {
        serde_json::from_value(serde_json::json!({"username": "u", "password": "p"})).unwrap()
    }

    #[test]
    fn nothing_is_held_unless_serving() {
        let credentials = Credentials::default();
        assert_eq!(credentials.can_hold(), Err(CredentialRefusal::NotServing));
        assert_eq!(
            credentials.hold(&[run("r-1")], &auth()),
            Err(CredentialRefusal::NotServing)
        );
        assert_eq!(credentials.for_start(&run("r-1")), None);
    }

    #[test]
    fn a_credential_is_freed_exactly_once_whichever_path_ends_the_run() {
        let credentials = Credentials::default();
        credentials.open(Duration::from_secs(600));
        credentials
            .hold(
                &[run("taken"), run("unrecorded"), run("never-taken")],
                &auth(),
            )
            .unwrap();
        // The node takes the run: sent in its start, then let go when the start is answered.
        assert_eq!(credentials.for_start(&run("taken")), Some(auth()));
        assert!(credentials.release(&run("taken")));
        assert!(
            !credentials.release(&run("taken")),
            "a second release frees nothing"
        );
        assert_eq!(credentials.for_start(&run("taken")), None);
        // The set could not be recorded.
        assert!(credentials.release(&run("unrecorded")));
        // Nobody takes the run: held past the waiting timeout, then let go once.
        let within = Instant::now() + Duration::from_secs(600);
        assert_eq!(credentials.expire_at(within), 0, "still takable");
        let past = Instant::now() + Duration::from_secs(3600);
        assert_eq!(credentials.expire_at(past), 1);
        assert_eq!(credentials.expire_at(past), 0);
        assert!(!credentials.release(&run("never-taken")));
        assert!(
            credentials.state.lock().by_run.is_empty(),
            "nothing is left held"
        );
    }
}
