//! Ids the coordinator mints: a run's and a set's, random so that coordinators sharing a store
//! never mint the same one.
use fleet_proto::{RunId, SetId};
use rand::RngCore;

fn random_id(prefix: &str) -> String {
    let mut raw = [0u8; 6];
    rand::thread_rng().fill_bytes(&mut raw);
    format!("{prefix}-{}", hex::encode(raw))
}

pub(crate) fn new_run_id() -> RunId {
    // Cannot fail: `r-` and 12 hex digits is always a valid run id.
    RunId::parse(&random_id("r")).expect("r-HEX is a run id")
}

pub(crate) fn new_set_id() -> SetId {
    SetId::new(random_id("s"))
}
