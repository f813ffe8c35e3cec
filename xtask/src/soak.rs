//! `cargo xtask soak`: SIGKILL the agent at random moments across many runs; every run happens once.
use anyhow::{Result, bail};

pub fn run(_kills: usize) -> Result<()> {
    bail!("the soak is not written yet")
}
