//! The one time every image gets: `SOURCE_DATE_EPOCH` when set, else 0. The wall clock is never read.
use crate::local::tar::MAX_MTIME;

/// Why `SOURCE_DATE_EPOCH` was refused.
#[derive(Debug, thiserror::Error)]
#[error(
    "bad SOURCE_DATE_EPOCH {0:?}: expected whole seconds since 1970 from 0 to {MAX_MTIME}, or unset it"
)]
pub struct EpochError(pub String);

/// The fixed time of an image: `SOURCE_DATE_EPOCH` (seconds since 1970), or 0 when unset or empty.
pub fn source_date_epoch() -> Result<u64, EpochError> {
    match std::env::var("SOURCE_DATE_EPOCH") {
        Err(std::env::VarError::NotPresent) => Ok(0),
        Err(std::env::VarError::NotUnicode(v)) => Err(EpochError(v.to_string_lossy().into_owned())),
        Ok(v) if v.is_empty() => Ok(0),
        Ok(v) => match v.parse::<u64>() {
            Ok(n) if n <= MAX_MTIME && v.bytes().all(|b| b.is_ascii_digit()) => Ok(n),
            _ => Err(EpochError(v)),
        },
    }
}

/// RFC 3339 UTC for seconds since 1970, as image configs want it: `1970-01-01T00:00:00Z`.
pub fn rfc3339(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Howard Hinnant's days-to-civil algorithm (proleptic Gregorian calendar).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::rfc3339;

    #[test]
    fn formats_known_instants() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_700_000_000), "2023-11-14T22:13:20Z");
    }
}
