//! The two-phase token, `v1.<system_identifier>.<xid>`: names a PostgreSQL cluster and a
//! transaction in it, so intents enqueued with it exist if and only if it commits.

use std::fmt;
use std::str::FromStr;

/// A parsed two-phase token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TxnToken {
    /// `system_identifier` of the producer's cluster (`pg_control_system()`).
    pub system_identifier: u64,
    /// Full 64-bit transaction id (`pg_current_xact_id()`).
    pub xid: u64,
}

/// Why a string is not a token.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "is not a two-phase token: expected v1.<system identifier>.<transaction id>, as \
     returned by outbox.txn_token() or SELECT 'v1.' || system_identifier || '.' || \
     pg_current_xact_id() FROM pg_control_system()"
)]
pub struct MalformedToken;

impl FromStr for TxnToken {
    type Err = MalformedToken;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut parts = s.split('.');
        let (Some("v1"), Some(system), Some(xid), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(MalformedToken);
        };
        let number = |p: &str| {
            // u64::from_str accepts a leading '+'; a token never has one.
            if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) {
                return Err(MalformedToken);
            }
            p.parse::<u64>().map_err(|_| MalformedToken)
        };
        Ok(Self {
            system_identifier: number(system)?,
            xid: number(xid)?,
        })
    }
}

impl fmt::Display for TxnToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "v1.{}.{}", self.system_identifier, self.xid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_round_trips_and_garbage_is_refused() {
        let t: TxnToken = "v1.7312345678901234567.7421".parse().unwrap();
        assert_eq!(t.system_identifier, 7312345678901234567);
        assert_eq!(t.xid, 7421);
        assert_eq!(t.to_string(), "v1.7312345678901234567.7421");
        for bad in [
            "",
            "v1",
            "v1.1",
            "v2.1.2",
            "v1.1.2.3",
            "v1.a.2",
            "v1.1.+2",
            "v1.1.99999999999999999999",
        ] {
            assert!(bad.parse::<TxnToken>().is_err(), "{bad}");
        }
    }
}
