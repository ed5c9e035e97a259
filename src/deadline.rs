//! The caller's deadline (its `grpc-timeout` header): a long poll answers before its caller
//! gives up. Past that deadline tonic drops the call, and what a last look had leased
//! would reach no worker, its attempt counted, until the lease expired.

use std::time::Duration;

use tonic::metadata::MetadataMap;

/// How long before the caller's deadline a long poll stops waiting, for its last look and
/// the answer's way back: a tenth of the caller's timeout, within these bounds. The least
/// covers what a loaded server or database adds: a last look waiting for a pooled
/// connection, a call that first opened its connection.
const MARGIN_MIN: Duration = Duration::from_millis(250);
const MARGIN_MAX: Duration = Duration::from_secs(1);

/// The caller's timeout, when its `grpc-timeout` header holds one (gRPC over HTTP/2: at
/// most 8 digits, then the unit), read as tonic reads it to enforce it: a malformed header
/// counts as none.
pub fn caller_timeout(metadata: &MetadataMap) -> Option<Duration> {
    grpc_timeout(metadata.get("grpc-timeout")?.to_str().ok()?)
}

/// A `grpc-timeout` header's value as [`caller_timeout`] reads it.
pub fn grpc_timeout(value: &str) -> Option<Duration> {
    let digits = value.get(..value.len().checked_sub(1)?)?;
    if digits.len() > 8 {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match &value[digits.len()..] {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// How long a long poll asked to `wait` may wait for a caller that gives up after
/// `timeout`: until a margin before that.
pub fn bounded_wait(wait: Duration, timeout: Option<Duration>) -> Duration {
    let Some(timeout) = timeout else {
        return wait;
    };
    let margin = (timeout / 10).clamp(MARGIN_MIN, MARGIN_MAX);
    wait.min(timeout.saturating_sub(margin))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timeout_of(header: &str) -> Option<Duration> {
        let mut metadata = MetadataMap::new();
        metadata.insert("grpc-timeout", header.parse().unwrap());
        caller_timeout(&metadata)
    }

    #[test]
    fn the_grpc_timeout_header_is_read_in_each_unit_and_garbage_is_none() {
        assert_eq!(timeout_of("2H"), Some(Duration::from_secs(7200)));
        assert_eq!(timeout_of("3M"), Some(Duration::from_secs(180)));
        assert_eq!(timeout_of("20S"), Some(Duration::from_secs(20)));
        assert_eq!(timeout_of("1500m"), Some(Duration::from_millis(1500)));
        assert_eq!(
            timeout_of("99999999u"),
            Some(Duration::from_micros(99_999_999))
        );
        assert_eq!(timeout_of("7n"), Some(Duration::from_nanos(7)));
        assert_eq!(
            timeout_of("+5S"),
            Some(Duration::from_secs(5)),
            "as tonic reads it"
        );
        for bad in ["", "S", "5", "5s", "123456789S", "-5S", "5 S", "5SS"] {
            assert_eq!(timeout_of(bad), None, "{bad:?}");
        }
        assert_eq!(caller_timeout(&MetadataMap::new()), None);
    }

    #[test]
    fn a_long_poll_ends_a_tenth_of_the_callers_timeout_before_it_within_bounds() {
        let s = Duration::from_secs;
        let ms = Duration::from_millis;
        assert_eq!(bounded_wait(s(20), None), s(20), "no deadline");
        assert_eq!(bounded_wait(s(5), Some(s(60))), s(5), "well inside it");
        assert_eq!(
            bounded_wait(s(20), Some(ms(20_050))),
            ms(19_050),
            "at most 1 s before"
        );
        assert_eq!(bounded_wait(s(20), Some(s(5))), ms(4_500), "a tenth");
        assert_eq!(
            bounded_wait(s(20), Some(s(1))),
            ms(750),
            "at least 250 ms before"
        );
        assert_eq!(
            bounded_wait(s(20), Some(ms(200))),
            ms(0),
            "no time to wait at all"
        );
    }
}
