//! Copies of content from another coordinator under way: one at a time per digest, since they
//! land through the same partial file (the second finds the blob in place once the first ends).
use super::guarded::Guarded;
use fleet_proto::Digest;
use std::collections::HashMap;
use std::sync::{Arc, Weak};
use tokio::sync::{Mutex, OwnedMutexGuard};

#[derive(Default)]
pub(crate) struct Pulls {
    by_digest: Guarded<HashMap<Digest, Weak<Mutex<()>>>>,
}

impl Pulls {
    /// Waits until no other copy of `digest` is under way here; the copy is this one's while
    /// the guard lives.
    pub(crate) async fn one_at_a_time(&self, digest: &Digest) -> OwnedMutexGuard<()> {
        let lock = {
            let mut by_digest = self.by_digest.lock();
            // Entries of copies that ended go, so memory follows the copies under way.
            by_digest.retain(|_, held| held.strong_count() > 0);
            match by_digest.get(digest).and_then(Weak::upgrade) {
                Some(lock) => lock,
                None => {
                    let lock = Arc::new(Mutex::new(()));
                    by_digest.insert(*digest, Arc::downgrade(&lock));
                    lock
                }
            }
        };
        lock.lock_owned().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_second_copy_of_the_same_digest_waits_for_the_first() {
        let pulls = Pulls::default();
        let a = Digest::of_reader(&b"a"[..]).unwrap();
        let b = Digest::of_reader(&b"b"[..]).unwrap();
        let first = pulls.one_at_a_time(&a).await;
        let second = tokio::time::timeout(Duration::from_millis(100), pulls.one_at_a_time(&a));
        assert!(second.await.is_err(), "the same digest waits");
        let other = tokio::time::timeout(Duration::from_secs(5), pulls.one_at_a_time(&b));
        assert!(other.await.is_ok(), "another digest does not");
        drop(first);
        let again = tokio::time::timeout(Duration::from_secs(5), pulls.one_at_a_time(&a));
        assert!(again.await.is_ok(), "once the first ended, the next goes");
        assert!(
            pulls.by_digest.lock().len() <= 1,
            "ended copies are forgotten"
        );
    }
}
