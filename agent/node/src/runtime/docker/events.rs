//! The engine's event stream: every end of this agent's containers is noted in [`Changes`].
use super::{Changes, LABEL_AGENT, labelled_run};
use bollard::Docker;
use bollard::query_parameters::EventsOptions;
use futures_util::StreamExt;
use std::collections::HashMap;
use std::time::Duration;

/// The pause before the engine's event stream is opened again once it was cut.
const EVENTS_RETRY: Duration = Duration::from_secs(1);

/// Notes every end of this agent's containers as the engine reports it (`die`); a cut stream
/// is opened again after [`EVENTS_RETRY`] (the agent's watch covers the gap).
pub(super) async fn watch_events(docker: Docker, agent: String, changes: Changes) {
    let options = EventsOptions {
        filters: Some(HashMap::from([
            ("type".to_string(), vec!["container".to_string()]),
            ("event".to_string(), vec!["die".to_string()]),
            ("label".to_string(), vec![format!("{LABEL_AGENT}={agent}")]),
        ])),
        ..Default::default()
    };
    loop {
        let mut events = docker.events(Some(options.clone()));
        while let Some(Ok(event)) = events.next().await {
            let attributes = event.actor.and_then(|a| a.attributes);
            if let Some(run_id) = labelled_run(attributes.as_ref()) {
                changes.note(&run_id);
            }
        }
        tokio::time::sleep(EVENTS_RETRY).await;
    }
}
