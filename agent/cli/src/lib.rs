//! What the fleet's binaries (`fleet-agent`, `fleet-coordinator`, `fleet-loadgen`) share around
//! their work: logging set up once, a fatal error as one line and exit status 1, the one-thread
//! async runtime and the stop signals, blocking work off the async thread, and durations as
//! people write them.
pub mod binary;
pub mod blocking;
pub mod duration;
pub mod logging;
