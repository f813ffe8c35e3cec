//! `cargo xtask demo`: the main job end to end on the embedded default, on loopback.
use anyhow::{Result, bail};

pub fn run() -> Result<()> {
    bail!("the demo is not written yet")
}
