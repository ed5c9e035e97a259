//! The queue levels this server knows to be registered, so that its Enqueues register only
//! new ones (an index probe per level and call saved; docs/flow-control.md).

use std::collections::HashSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::outbox::NewIntent;

/// Levels remembered at most: past this, the rest are registered by every Enqueue, as
/// before the cache, so a tenant's stream of new kinds costs bounded memory.
const MAX_KNOWN_LEVELS: usize = 10_000;

/// Connections opened by this process so far ([`connection_opened`]).
static CONNECTIONS_OPENED: AtomicU64 = AtomicU64::new(0);

/// Called for every new database connection. A new connection may lead to another
/// database than the last one (a failover to a standby that missed a commit, a restore),
/// where a level this server saw registered may not exist: what was known is forgotten.
pub fn connection_opened() {
    CONNECTIONS_OPENED.fetch_add(1, Ordering::SeqCst);
}

/// A level: tenant, kind, priority.
type Level = (String, String, i16);

/// Levels seen committed since the connections counted in `epoch` were opened.
#[derive(Debug)]
pub struct KnownLevels {
    known: Mutex<Known>,
    opened: &'static AtomicU64,
}

impl Default for KnownLevels {
    fn default() -> Self {
        Self {
            known: Mutex::default(),
            opened: &CONNECTIONS_OPENED,
        }
    }
}

#[derive(Debug, Default)]
struct Known {
    epoch: u64,
    levels: HashSet<Level>,
}

/// What one Enqueue registers: its levels not known before it began.
#[derive(Debug, Default)]
pub struct NewLevels {
    epoch: u64,
    levels: Vec<Level>,
}

impl NewLevels {
    /// The kinds and priorities to register, pairwise.
    pub fn kinds_and_priorities(&self) -> (Vec<&str>, Vec<i16>) {
        self.levels
            .iter()
            .map(|(_, kind, priority)| (kind.as_str(), *priority))
            .unzip()
    }
}

impl KnownLevels {
    /// The levels of `tenant`'s `intents` not known to be registered. Asked once the
    /// Enqueue's transaction has its connection, so that a connection opened for it counts.
    pub fn unknown(&self, tenant: &str, intents: &[NewIntent]) -> NewLevels {
        let epoch = self.opened.load(Ordering::SeqCst);
        let mut known = self.known.lock().unwrap_or_else(|e| e.into_inner());
        if known.epoch != epoch {
            known.levels.clear();
            known.epoch = epoch;
        }
        let mut levels: Vec<Level> = Vec::new();
        for intent in intents {
            let level = (tenant.to_owned(), intent.kind.clone(), intent.priority);
            if !known.levels.contains(&level) && !levels.contains(&level) {
                levels.push(level);
            }
        }
        NewLevels { epoch, levels }
    }

    /// Remembers `new` once the Enqueue that registered it has committed; not when a
    /// connection was opened meanwhile (it may lead elsewhere).
    pub fn registered(&self, new: NewLevels) {
        if new.levels.is_empty() || self.opened.load(Ordering::SeqCst) != new.epoch {
            return;
        }
        let mut known = self.known.lock().unwrap_or_else(|e| e.into_inner());
        if known.epoch != new.epoch {
            return;
        }
        for level in new.levels {
            if known.levels.len() >= MAX_KNOWN_LEVELS {
                break;
            }
            known.levels.insert(level);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn intent(kind: &str, priority: i16) -> NewIntent {
        NewIntent {
            kind: kind.to_owned(),
            payload: Vec::new(),
            content_type: String::new(),
            region: String::new(),
            idempotency_key: None,
            ordering_key: None,
            priority,
            headers: Default::default(),
            max_attempts: 5,
            schedule: crate::outbox::Schedule::Now,
        }
    }

    /// Levels counting connections of their own, apart from other tests'.
    fn known_levels() -> (KnownLevels, &'static AtomicU64) {
        let opened: &'static AtomicU64 = Box::leak(Box::new(AtomicU64::new(0)));
        let known = KnownLevels {
            known: Mutex::default(),
            opened,
        };
        (known, opened)
    }

    #[test]
    fn a_level_is_registered_until_its_enqueue_committed_then_no_more() {
        let (known, _) = known_levels();
        let batch = [
            intent("a", 0),
            intent("a", 0),
            intent("a", 5),
            intent("b", 0),
        ];
        let first = known.unknown("t", &batch);
        assert_eq!(
            first.kinds_and_priorities(),
            (vec!["a", "a", "b"], vec![0, 5, 0])
        );
        assert_eq!(
            known.unknown("t", &batch).levels.len(),
            3,
            "not known before the commit"
        );
        known.registered(first);
        assert!(known.unknown("t", &batch).levels.is_empty());
        assert_eq!(
            known.unknown("u", &batch).levels.len(),
            3,
            "levels are a tenant's"
        );
    }

    #[test]
    fn a_new_connection_forgets_every_level() {
        let (known, opened) = known_levels();
        let batch = [intent("a", 0)];
        known.registered(known.unknown("t", &batch));
        let during = known.unknown("t", &[intent("b", 0)]);
        opened.fetch_add(1, Ordering::SeqCst);
        known.registered(during);
        assert_eq!(known.unknown("t", &batch).levels.len(), 1);
        assert_eq!(
            known.unknown("t", &[intent("b", 0)]).levels.len(),
            1,
            "one registered while a connection opened is not remembered"
        );
    }
}
