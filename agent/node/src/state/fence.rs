//! Fencing: the highest session generation seen, so a command from a superseded session is refused.
use super::{StateError, Store};

const META_GENERATION: &str = "generation";

impl Store {
    /// The highest session generation seen so far (0 before the first session).
    pub fn generation(&self) -> Result<u64, StateError> {
        self.read(|tx| self.meta_value(tx, META_GENERATION))
    }

    /// Accepts a command carrying generation `g` if no newer generation was seen, remembering `g`
    /// durably when it is the newest; refuses it with [`StateError::Superseded`] otherwise.
    pub fn check_generation(&self, g: u64) -> Result<(), StateError> {
        // Fast path without a write: the common case is a command of the current session.
        let current = self.generation()?;
        if g < current {
            return Err(StateError::Superseded { got: g, current });
        }
        if g == current {
            return Ok(());
        }
        self.write(|tx| {
            let current = self.counter(tx, META_GENERATION)?;
            if g < current {
                return Err(StateError::Superseded { got: g, current });
            }
            let mut meta = tx.open_table(super::META).map_err(|e| self.fail(e))?;
            meta.insert(META_GENERATION, g).map_err(|e| self.fail(e))?;
            Ok(())
        })
    }
}
