//! One module per command; each turns parsed arguments into store reads or a run.
pub mod collect;
pub mod show;
pub mod stage;
pub mod start;
pub mod stop;

/// Turns an I/O error into one line: `what: reason`.
pub fn io_line(what: impl std::fmt::Display) -> impl FnOnce(std::io::Error) -> anyhow::Error {
    move |e| anyhow::anyhow!("{what}: {}", run_store::describe_io(&e))
}
