//! `cargo xtask bench registry`.
use anyhow::{Result, bail};

pub fn run() -> Result<()> {
    bail!("the registry benchmark is not written yet")
}
