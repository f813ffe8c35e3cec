//! One module per command; each turns parsed arguments into store reads or a run.
pub mod collect;
pub mod show;
pub mod stage;
pub mod start;
pub mod stop;

use run_store::Refusal;

/// A one-line refusal that exits with its class's status (see `run_store::exit`).
#[derive(Debug)]
pub struct Refused {
    pub class: Refusal,
    pub line: String,
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.line)
    }
}

impl std::error::Error for Refused {}

/// A refusal of `class` saying `line`.
pub fn refuse(class: Refusal, line: impl std::fmt::Display) -> anyhow::Error {
    Refused {
        class,
        line: line.to_string(),
    }
    .into()
}

/// Turns an I/O error into one line, `what: reason`, exiting with its class's status; a full
/// disk also says what to do.
pub fn io_line(what: impl std::fmt::Display) -> impl FnOnce(std::io::Error) -> anyhow::Error {
    move |e| {
        let class = Refusal::of_io(&e);
        let reason = run_store::describe_io(&e);
        refuse(class, format!("{what}: {reason}{}", class.advice()))
    }
}

/// The exit status for an error: its refusal class, found anywhere in its chain.
pub fn exit_code(e: &anyhow::Error) -> i32 {
    e.chain()
        .find_map(|cause| {
            (cause.downcast_ref::<Refused>().map(|r| r.class)).or_else(|| {
                cause
                    .downcast_ref::<run_store::Error>()
                    .map(|e| e.refusal())
            })
        })
        .unwrap_or(Refusal::Other)
        .code()
}
