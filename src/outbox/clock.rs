//! Where "now" comes from: PostgreSQL's clock in production, a manual clock in tests, so
//! lease expiry and backoff are tested by moving time instead of sleeping (River's `now`).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};

/// Source of the current time for every state transition.
#[derive(Debug, Clone, Default)]
pub enum Clock {
    /// Use the database's `now()`: one clock for every replica.
    #[default]
    Database,
    /// A clock that only moves when told to.
    Manual(Arc<Mutex<DateTime<Utc>>>),
}

impl Clock {
    /// A manual clock starting at `start`.
    pub fn manual(start: DateTime<Utc>) -> Self {
        Self::Manual(Arc::new(Mutex::new(start)))
    }

    /// The instant to pass to SQL as `coalesce($now, now())`; `None` means the database's clock.
    pub fn now(&self) -> Option<DateTime<Utc>> {
        match self {
            Self::Database => None,
            Self::Manual(now) => Some(*now.lock().unwrap_or_else(|e| e.into_inner())),
        }
    }

    /// Moves a manual clock forward; does nothing to the database clock.
    pub fn advance(&self, by: Duration) {
        if let Self::Manual(now) = self {
            let mut now = now.lock().unwrap_or_else(|e| e.into_inner());
            *now += chrono::Duration::from_std(by).unwrap_or(chrono::Duration::MAX);
        }
    }
}
