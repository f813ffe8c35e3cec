//! `cargo xtask bench agent`.
use anyhow::{Result, bail};

pub fn run() -> Result<()> {
    bail!("the agent benchmark is not written yet")
}
