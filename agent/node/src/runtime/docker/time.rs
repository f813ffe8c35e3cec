//! The engine's times (`2026-12-01T07:05:01.123456789Z`, UTC) read back as instants, for
//! judging a run's timeout from the moment the engine started it.
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Reads an RFC 3339 UTC time as the engine writes it; `None` for anything else (the engine's
/// zero time included).
pub(super) fn parse_rfc3339(text: &str) -> Option<SystemTime> {
    let text = text.strip_suffix('Z')?;
    let (date, time) = text.split_once('T')?;
    let mut date = date.splitn(3, '-').map(|p| p.parse::<i64>().ok());
    let (y, m, d) = (date.next()??, date.next()??, date.next()??);
    let (hms, frac) = time.split_once('.').unwrap_or((time, ""));
    let mut hms = hms.splitn(3, ':').map(|p| p.parse::<u64>().ok());
    let (h, min, s) = (hms.next()??, hms.next()??, hms.next()??);
    // RFC 3339 years have four digits; a larger one would overflow the seconds below.
    if !(0..=9999).contains(&y)
        || !(1..=12).contains(&m)
        || !(1..=31).contains(&d)
        || h > 23
        || min > 59
        || s > 60
    {
        return None;
    }
    let nanos = if frac.is_empty() {
        0
    } else {
        let digits: String = frac.chars().chain(std::iter::repeat('0')).take(9).collect();
        digits.parse::<u32>().ok()?
    };
    let days = days_from_civil(y, m as u32, d as u32);
    let secs = u64::try_from(days).ok()? * 86_400 + h * 3600 + min * 60 + s;
    Some(UNIX_EPOCH + Duration::new(secs, nanos))
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (i64::from(m) + 9) % 12;
    let doy = (153 * mp + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_engines_times_and_the_supervisors() {
        let t = |s| parse_rfc3339(s).map(|t| t.duration_since(UNIX_EPOCH).unwrap());
        assert_eq!(t("1970-01-01T00:00:00Z"), Some(Duration::ZERO));
        assert_eq!(
            t("2000-02-29T01:02:03.000005Z"),
            Some(Duration::new(951_782_400 + 3_723, 5_000))
        );
        // The same instant as the supervisor's clock formats it, so the two agree.
        let now = SystemTime::now();
        let back = parse_rfc3339(&run_store::clock::rfc3339(now)).unwrap();
        assert!(now.duration_since(back).unwrap() < Duration::from_micros(1));
        assert_eq!(
            t("2026-12-01T15:20:13.123456789Z").unwrap().subsec_nanos(),
            123_456_789
        );
        assert_eq!(t("0001-01-01T00:00:00Z"), None);
        assert_eq!(t("999999999999999-01-01T00:00:00Z"), None);
        assert_eq!(t("yesterday"), None);
    }
}
