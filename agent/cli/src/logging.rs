//! Logging through `tracing` to stderr: human-readable by default, one JSON object per line with
//! `--log-format json`. `RUST_LOG` narrows or widens what is shown: a default level and
//! `TARGET=LEVEL` pairs, comma-separated (`info`, `warn,fleet_agent=debug`; default `info`). The
//! filter is `tracing_subscriber`'s `Targets`, not its `EnvFilter`: the same directives people
//! write, without a regex engine in every binary (`EnvFilter` brings `regex-automata`).
use tracing::level_filters::LevelFilter;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::prelude::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Human,
    Json,
}

/// What `RUST_LOG` asks for, or `info`; a value that does not parse is named once on stderr.
fn filter() -> Targets {
    let default = Targets::new().with_default(LevelFilter::INFO);
    match std::env::var("RUST_LOG") {
        Ok(text) if !text.trim().is_empty() => text.parse().unwrap_or_else(|e| {
            eprintln!(
                "RUST_LOG={text:?} is not a level or TARGET=LEVEL pairs ({e}); logging at info"
            );
            default
        }),
        _ => default,
    }
}

pub fn init(format: LogFormat) {
    use std::io::IsTerminal;
    let layer = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_target(false);
    let registry = tracing_subscriber::registry();
    match format {
        LogFormat::Human => {
            let layer = layer.with_ansi(std::io::stderr().is_terminal());
            registry.with(layer.with_filter(filter())).init()
        }
        LogFormat::Json => {
            let layer = layer.json().with_ansi(false);
            registry.with(layer.with_filter(filter())).init()
        }
    }
}

#[cfg(test)]
mod tests {
    use tracing::level_filters::LevelFilter;
    use tracing_subscriber::filter::Targets;

    #[test]
    fn the_directives_people_write_parse() {
        let targets: Targets = "warn,fleet_agent=debug".parse().unwrap();
        assert_eq!(targets.default_level(), Some(LevelFilter::WARN));
        assert!(targets.would_enable("fleet_agent::session", &tracing::Level::DEBUG));
        assert!(!targets.would_enable("rustls", &tracing::Level::INFO));
        assert!("info".parse::<Targets>().is_ok());
    }
}
