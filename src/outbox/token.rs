//! The two-phase token, `v2.<system_identifier>.<incarnation>.<xid>`: names a PostgreSQL
//! cluster, the life of its server since the last crash recovery, and a transaction in it,
//! so intents enqueued with it exist if and only if that transaction commits.
//!
//! The incarnation is there because PostgreSQL hands a transaction id out again after a
//! crash when nothing it wrote reached disk: the xid alone could name a stranger's
//! transaction (see `outbox.server_incarnation` in migrations/…_baseline_functions.up.sql).

use std::fmt;
use std::str::FromStr;

/// The SQL that makes a token from any database of the cluster: the same value
/// `outbox.txn_token()` returns (without its commit notification), for producers whose
/// tables live in another database. README and the examples quote it.
///
/// Like `outbox.txn_token()`, it writes a transactional logical-decoding message: a
/// transaction that wrote no WAL has its COMMIT acknowledged before it is flushed (and
/// without waiting for a synchronous standby), so a producer that wrote nothing but its
/// token could be told COMMIT OK and lose it in a crash or a failover (see `outbox.txn_token`
/// in migration `…02_baseline_functions`).
pub const PLAIN_TOKEN_SQL: &str = "SELECT 'v2.' || system_identifier || '.' || \
     (extract(epoch FROM least(pg_stat_get_bgwriter_stat_reset_time(), \
     (SELECT stats_reset FROM pg_stat_archiver))) * 1000000)::bigint || '.' || \
     pg_current_xact_id() FROM pg_control_system(), \
     pg_logical_emit_message(true, 'outboxd', '')";

/// A parsed two-phase token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TxnToken {
    /// `system_identifier` of the producer's cluster (`pg_control_system()`), as the
    /// signed bigint PostgreSQL prints: negative for clusters created from 2038-01-19 on
    /// (the identifier's top bits are the creation time in seconds).
    pub system_identifier: i64,
    /// `outbox.server_incarnation()` when the token was taken.
    pub incarnation: u64,
    /// Full 64-bit transaction id (`pg_current_xact_id()`).
    pub xid: u64,
}

/// Why a string is not a token.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// Not a token at all.
    #[error(
        "is not a two-phase token: expected v2.<system identifier>.<server incarnation>.\
         <transaction id>, as returned by outbox.txn_token() (or the plain SQL in the README \
         for other databases)"
    )]
    Malformed,
    /// A v1 token, which cannot tell a transaction id reused after a crash.
    #[error(
        "is a v1 token, which outboxd no longer accepts: after a PostgreSQL crash its \
         transaction id can name another transaction. Take a v2 token with outbox.txn_token() \
         (or the plain SQL in the README for other databases)"
    )]
    Retired,
}

impl FromStr for TxnToken {
    type Err = TokenError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut parts = s.split('.');
        match parts.next() {
            Some("v2") => {}
            Some("v1") => return Err(TokenError::Retired),
            _ => return Err(TokenError::Malformed),
        }
        let token = Self {
            system_identifier: field(&mut parts, Sign::Allowed)?,
            incarnation: field(&mut parts, Sign::None)?,
            xid: field(&mut parts, Sign::None)?,
        };
        match parts.next() {
            None => Ok(token),
            Some(_) => Err(TokenError::Malformed),
        }
    }
}

/// Whether a token's number may be negative.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Sign {
    Allowed,
    None,
}

/// The next number of a token: digits only (from_str would also take a leading '+', and a
/// '-' where the number is unsigned), with a '-' only where `sign` allows one.
fn field<T: FromStr>(parts: &mut std::str::Split<'_, char>, sign: Sign) -> Result<T, TokenError> {
    let p = parts.next().ok_or(TokenError::Malformed)?;
    let unsigned = match p.strip_prefix('-') {
        Some(rest) if sign == Sign::Allowed => rest,
        _ => p,
    };
    if unsigned.is_empty() || !unsigned.bytes().all(|b| b.is_ascii_digit()) {
        return Err(TokenError::Malformed);
    }
    p.parse().map_err(|_| TokenError::Malformed)
}

impl fmt::Display for TxnToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "v2.{}.{}.{}",
            self.system_identifier, self.incarnation, self.xid
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_round_trips_and_garbage_is_refused() {
        let t: TxnToken = "v2.7312345678901234567.1796025600123456.7421"
            .parse()
            .unwrap();
        assert_eq!(t.system_identifier, 7312345678901234567);
        assert_eq!(t.incarnation, 1796025600123456);
        assert_eq!(t.xid, 7421);
        assert_eq!(
            t.to_string(),
            "v2.7312345678901234567.1796025600123456.7421"
        );
        for bad in [
            "",
            "v2",
            "v2.1.2",
            "v3.1.2.3",
            "v2.1.2.3.4",
            "v2.a.2.3",
            "v2.1.2.+3",
            "v2.1..3",
            "v2.1.2.99999999999999999999",
        ] {
            assert_eq!(bad.parse::<TxnToken>(), Err(TokenError::Malformed), "{bad}");
        }
    }

    #[test]
    fn a_token_of_a_cluster_created_after_2038_has_a_negative_system_identifier() {
        // 2^31 seconds since 1970 in the top 32 bits: PostgreSQL's bigint prints it negative.
        let t: TxnToken = "v2.-9223372036854775807.1796025600123456.7421"
            .parse()
            .unwrap();
        assert_eq!(t.system_identifier, -9223372036854775807);
        assert_eq!(
            t.to_string(),
            "v2.-9223372036854775807.1796025600123456.7421"
        );
        for bad in [
            "v2.-.2.3",
            "v2.--1.2.3",
            "v2.1.-2.3",
            "v2.1.2.-3",
            "v2.+1.2.3",
        ] {
            assert_eq!(bad.parse::<TxnToken>(), Err(TokenError::Malformed), "{bad}");
        }
    }

    #[test]
    fn a_v1_token_is_refused_with_the_reason() {
        assert_eq!(
            "v1.7312345678901234567.7421".parse::<TxnToken>(),
            Err(TokenError::Retired)
        );
    }
}
