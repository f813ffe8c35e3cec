//! `cargo xtask bench build`.
use anyhow::{Result, bail};

pub fn run() -> Result<()> {
    bail!("the build benchmark is not written yet")
}
