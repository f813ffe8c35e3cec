//! The content a command reads, fetched before its work goes to the blocking pool: the work
//! meets each answer at its own step (a fetch that failed refuses there, in order), and never
//! waits on the network itself.
use fleet_proto::Digest;
use fleet_proto::protocol::{Refusal, RefusalClass};
use std::collections::HashMap;
use std::path::PathBuf;

/// Each digest fetched ahead of a command, with the node's checked copy or why there is none.
#[derive(Debug, Default)]
pub struct Fetched(HashMap<Digest, Result<PathBuf, Refusal>>);

impl Fetched {
    pub fn keep(&mut self, digest: Digest, answer: Result<PathBuf, Refusal>) {
        self.0.insert(digest, answer);
    }

    pub fn has(&self, digest: &Digest) -> bool {
        self.0.contains_key(digest)
    }

    /// Every digest fetched ahead.
    pub fn digests(&self) -> Vec<Digest> {
        self.0.keys().copied().collect()
    }

    /// The copy of `digest`, or why it could not be had.
    pub fn get(&self, digest: &Digest) -> Result<PathBuf, Refusal> {
        match self.0.get(digest) {
            Some(answer) => answer.clone(),
            None => Err(Refusal::new(
                RefusalClass::NotStaged,
                format!(
                    "content {digest}: it was not fetched ahead of its command; send the command again"
                ),
            )),
        }
    }
}
