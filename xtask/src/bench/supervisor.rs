//! `cargo xtask bench supervisor`.
use anyhow::{Result, bail};

pub fn run() -> Result<()> {
    bail!("the supervisor benchmark is not written yet")
}
