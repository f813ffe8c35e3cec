//! The event spool: run state changes with stable, monotonic ids, kept until the coordinator acks them.
use super::{StateError, Store, now_unix_ms};
use fleet_proto::RunId;
use fleet_proto::run::{Event, RunReport, RunState};
use redb::{ReadableTable, TableDefinition, WriteTransaction};

/// event id -> JSON [`Event`].
const EVENTS: TableDefinition<u64, &[u8]> = TableDefinition::new("events");
/// The last id handed out. Kept apart from `EVENTS` so acked (deleted) ids are never handed out again.
const META_EVENT_ID: &str = "event_id";

impl Store {
    /// Appends an event durably and returns it with its id.
    pub fn append_event(
        &self,
        run_id: &RunId,
        state: RunState,
        report: RunReport,
    ) -> Result<Event, StateError> {
        self.write(|tx| self.append_in(tx, run_id, state, report))
    }

    /// Appends inside a caller's transaction, so a state change and its event commit together.
    pub(super) fn append_in(
        &self,
        tx: &WriteTransaction,
        run_id: &RunId,
        state: RunState,
        report: RunReport,
    ) -> Result<Event, StateError> {
        let id = self.take_next(tx, META_EVENT_ID)?;
        let event = Event {
            id,
            run_id: run_id.clone(),
            state,
            report,
            at_unix_ms: now_unix_ms(),
        };
        // Cannot fail: events are plain data with string keys, which always serialize.
        let bytes = serde_json::to_vec(&event).expect("an event serializes");
        let mut events = tx.open_table(EVENTS).map_err(|e| self.fail(e))?;
        events
            .insert(id, bytes.as_slice())
            .map_err(|e| self.fail(e))?;
        Ok(event)
    }

    /// Up to `limit` spooled events with an id greater than `after`, oldest first.
    pub fn pending_events(&self, after: u64, limit: usize) -> Result<Vec<Event>, StateError> {
        self.read(|tx| {
            let events = match tx.open_table(EVENTS) {
                Ok(t) => t,
                Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
                Err(e) => return Err(self.fail(e)),
            };
            let mut out = Vec::new();
            for entry in events
                .range(after.saturating_add(1)..)
                .map_err(|e| self.fail(e))?
                .take(limit)
            {
                let (id, bytes) = entry.map_err(|e| self.fail(e))?;
                let event = serde_json::from_slice(bytes.value())
                    .map_err(|e| self.corrupt("event", &id.value().to_string(), e))?;
                out.push(event);
            }
            Ok(out)
        })
    }

    /// Drops every spooled event with an id up to and including `up_to`; returns how many went.
    pub fn ack_events(&self, up_to: u64) -> Result<u64, StateError> {
        self.write(|tx| {
            let mut events = tx.open_table(EVENTS).map_err(|e| self.fail(e))?;
            let mut dropped = 0;
            loop {
                let first = events.first().map_err(|e| self.fail(e))?;
                let Some(id) = first.map(|(id, _)| id.value()) else {
                    break;
                };
                if id > up_to {
                    break;
                }
                events.remove(id).map_err(|e| self.fail(e))?;
                dropped += 1;
            }
            Ok(dropped)
        })
    }

    /// The highest event id handed out so far (0 before the first).
    pub fn last_event_id(&self) -> Result<u64, StateError> {
        self.read(|tx| self.meta_value(tx, META_EVENT_ID))
    }

    /// Reads a counter in a read transaction, 0 when absent.
    pub(super) fn meta_value(
        &self,
        tx: &redb::ReadTransaction,
        name: &str,
    ) -> Result<u64, StateError> {
        let meta = tx.open_table(super::META).map_err(|e| self.fail(e))?;
        Ok(meta
            .get(name)
            .map_err(|e| self.fail(e))?
            .map(|v| v.value())
            .unwrap_or(0))
    }
}
