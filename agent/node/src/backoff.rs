//! Capped exponential backoff with jitter, so a fleet never retries in lockstep or in a tight loop.
use rand::Rng;
use std::time::Duration;

/// The longest wait between two attempts.
pub const CAP: Duration = Duration::from_secs(30);

#[derive(Debug, Clone)]
pub struct Backoff {
    base: Duration,
    cap: Duration,
    attempt: u32,
}

impl Backoff {
    pub fn new(base: Duration) -> Self {
        Backoff {
            base,
            cap: CAP,
            attempt: 0,
        }
    }

    /// The next wait: doubling from `base`, capped, with "equal jitter" (uniform in [d/2, d]).
    pub fn next_delay(&mut self) -> Duration {
        let factor = 2u32.saturating_pow(self.attempt.min(20));
        let full = self.base.saturating_mul(factor).min(self.cap);
        self.attempt = self.attempt.saturating_add(1);
        let half = full / 2;
        half + rand::thread_rng().gen_range(Duration::ZERO..=half)
    }

    /// Back to short waits after a success.
    pub fn reset(&mut self) {
        self.attempt = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_and_caps() {
        let mut b = Backoff::new(Duration::from_millis(100));
        let first = b.next_delay();
        assert!(first >= Duration::from_millis(50) && first <= Duration::from_millis(100));
        for _ in 0..30 {
            assert!(b.next_delay() <= CAP);
        }
        assert!(b.next_delay() >= CAP / 2);
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(100));
    }
}
