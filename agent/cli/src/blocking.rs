//! Blocking work (a disk, a store transaction) from async code, on tokio's blocking pool, so
//! the one async thread never waits for it. The one place the fleet's binaries spawn it.
use std::fmt;

/// The blocking task panicked or was cancelled before it returned.
#[derive(Debug)]
pub struct Unfinished(String);

impl fmt::Display for Unfinished {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "blocking work did not complete: {}", self.0)
    }
}

impl std::error::Error for Unfinished {}

impl From<Unfinished> for std::io::Error {
    fn from(e: Unfinished) -> std::io::Error {
        std::io::Error::other(e)
    }
}

/// Runs `work` on the blocking pool and waits for it; a task that never finished becomes `E`.
pub async fn off_thread<T, E>(work: impl FnOnce() -> Result<T, E> + Send + 'static) -> Result<T, E>
where
    T: Send + 'static,
    E: From<Unfinished> + Send + 'static,
{
    tokio::task::spawn_blocking(work)
        .await
        .unwrap_or_else(|e| Err(Unfinished(e.to_string()).into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panicking_task_is_an_error_not_a_panic() {
        let done: std::io::Result<u8> = off_thread(|| Ok(7)).await;
        assert_eq!(done.unwrap(), 7);
        let panicked: std::io::Result<u8> = off_thread(|| panic!("on purpose")).await;
        let line = panicked.unwrap_err().to_string();
        assert!(
            line.starts_with("blocking work did not complete: "),
            "{line}"
        );
    }
}
