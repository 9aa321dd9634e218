//! A scheduled data key rotation's period (`keyRotationSchedule`, docs/encryption.md,
//! "Scheduled rotation"): what the controller checks at CreateVolume and the node's scheduler
//! counts from the time the record's current key became current.

use std::time::Duration;

/// A day.
const DAY: u64 = 24 * 3600;

/// The period `text` names: `@hourly`, `@daily`, `@weekly`, `@monthly` (30 days), or `<n>`
/// followed by `s`, `m`, `h` or `d`, `n` at least 1. Anything else: why, without the text.
pub fn period(text: &str) -> Result<Duration, &'static str> {
    const WHY: &str = "@hourly, @daily, @weekly, @monthly, or <n>s, <n>m, <n>h, <n>d with n >= 1";
    let secs = match text {
        "@hourly" => 3600,
        "@daily" => DAY,
        "@weekly" => 7 * DAY,
        "@monthly" => 30 * DAY,
        _ => {
            let split = text.len().checked_sub(1).ok_or(WHY)?;
            let (n, unit) = text.split_at(split);
            let unit = match unit {
                "s" => 1,
                "m" => 60,
                "h" => 3600,
                "d" => DAY,
                _ => return Err(WHY),
            };
            if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
                return Err(WHY);
            }
            let n: u64 = n.parse().map_err(|_| WHY)?;
            if n == 0 {
                return Err(WHY);
            }
            n.checked_mul(unit).ok_or(WHY)?
        }
    };
    Ok(Duration::from_secs(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_names_and_periods_an_operator_writes() {
        let secs = |t| period(t).map(|d| d.as_secs());
        assert_eq!(secs("@hourly"), Ok(3600));
        assert_eq!(secs("@daily"), Ok(86_400));
        assert_eq!(secs("@weekly"), Ok(604_800));
        assert_eq!(secs("@monthly"), Ok(2_592_000));
        assert_eq!(secs("90d"), Ok(90 * 86_400));
        assert_eq!(secs("12h"), Ok(43_200));
        assert_eq!(secs("30m"), Ok(1800));
        assert_eq!(secs("5s"), Ok(5));
        for bad in [
            "",
            "d",
            "0d",
            "-1d",
            "+1d",
            "1w",
            "1.5h",
            "@yearly",
            "weekly",
            "1 d",
            "99999999999999999999s",
        ] {
            assert!(period(bad).is_err(), "{bad:?} taken");
        }
        assert!(period("999999999999999999d").is_err(), "overflow taken");
    }
}
