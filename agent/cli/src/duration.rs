//! Human durations on the command line: `500ms`, `30s`, `10m`, `1h`, or plain seconds.
use std::time::Duration;

/// A duration as people write it: `300 ms`, `90 s`.
pub fn human(d: Duration) -> String {
    if d.subsec_millis() == 0 {
        format!("{} s", d.as_secs())
    } else {
        format!("{} ms", d.as_millis())
    }
}

/// Why a duration cannot be read, in one line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct DurationError(String);

/// Parses `500ms`, `30s`, `10m`, `1h`, `2d` or a bare number of seconds.
pub fn parse(text: &str) -> Result<Duration, DurationError> {
    parse_line(text).map_err(DurationError)
}

fn parse_line(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("`{text}` is not a duration: write e.g. 500ms, 30s, 10m or 1h"))?;
    let seconds = match unit {
        "ms" => value / 1000.0,
        "" | "s" => value,
        "m" => value * 60.0,
        "h" => value * 3600.0,
        "d" => value * 86400.0,
        _ => {
            return Err(format!(
                "`{text}` has an unknown unit: use ms, s, m, h or d"
            ));
        }
    };
    Ok(Duration::from_secs_f64(seconds))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units() {
        assert_eq!(parse("1h").unwrap(), Duration::from_secs(3600));
        assert_eq!(parse("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse("7").unwrap(), Duration::from_secs(7));
        assert!(parse("soon").is_err());
        assert!(parse("3y").is_err());
    }
}
