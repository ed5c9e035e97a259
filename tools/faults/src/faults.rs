//! The faults the suite injects, and the timeline of what was injected when: the report
//! counts it, and the checker reads it to explain each duplicate delivery.

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::sync::{Mutex, PoisonError};

use serde::{Deserialize, Serialize};

/// A kind of fault.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    /// SIGKILL of an outboxd replica under load, restarted after a pause.
    OutboxdKill,
    /// SIGSTOP of an outboxd replica (a frozen process: calls hang, its transactions hold
    /// their locks), then SIGCONT.
    OutboxdStop,
    /// `pg_ctl stop -m immediate` (SIGQUIT to the postmaster), then crash recovery.
    PostgresCrash,
    /// `pg_terminate_backend` of every outboxd session (pools must recover).
    OutboxdSessionsKilled,
    /// Live intents' rows locked for seconds: calls on them block, holding pooled
    /// connections, which exhausts the small pool.
    LockStall,
    /// SIGKILL of a worker (often between its side effect and its Ack); replaced.
    WorkerKill,
    /// SIGSTOP of a worker for longer than its lease, then SIGCONT (late Ack).
    WorkerStop,
    /// The proxy drops the responses to the requests in flight on a replica, then resets.
    LostResponses,
    /// SIGKILL of a producer (often inside its transaction); replaced.
    ProducerKill,
    /// `pg_terminate_backend` of a producer session inside its transaction.
    ProducerBackendKilled,
    /// Clients giving up on calls of every kind 1 to 4 ms in, against every replica.
    CancelStorm,
}

impl FaultKind {
    /// Every fault the scheduler injects, in report order.
    pub const INJECTED: [FaultKind; 11] = [
        Self::OutboxdKill,
        Self::OutboxdStop,
        Self::PostgresCrash,
        Self::OutboxdSessionsKilled,
        Self::LockStall,
        Self::WorkerKill,
        Self::WorkerStop,
        Self::LostResponses,
        Self::ProducerKill,
        Self::ProducerBackendKilled,
        Self::CancelStorm,
    ];

    /// Row label in the report.
    pub fn label(self) -> &'static str {
        match self {
            Self::OutboxdKill => "outboxd SIGKILL under load (+ restart)",
            Self::OutboxdStop => "outboxd SIGSTOP, frozen replica (+ SIGCONT)",
            Self::PostgresCrash => "PostgreSQL crash, immediate stop (+ recovery)",
            Self::OutboxdSessionsKilled => "outboxd's PostgreSQL sessions terminated",
            Self::LockStall => "row-lock stall on leased intents (pool exhaustion)",
            Self::WorkerKill => "worker SIGKILL",
            Self::WorkerStop => "worker SIGSTOP past its lease (+ SIGCONT)",
            Self::LostResponses => "lost responses (proxy drops, then resets)",
            Self::ProducerKill => "producer SIGKILL",
            Self::ProducerBackendKilled => "producer backend terminated mid-transaction",
            Self::CancelStorm => "cancel storm (calls given up after 1-4 ms)",
        }
    }

    /// Whether the fault disturbs outboxd or PostgreSQL for every client (used to
    /// explain leases that expired while a worker could not get its Ack through).
    pub fn disrupts_service(self) -> bool {
        matches!(
            self,
            Self::OutboxdKill
                | Self::OutboxdStop
                | Self::PostgresCrash
                | Self::OutboxdSessionsKilled
                | Self::LockStall
                | Self::LostResponses
                | Self::CancelStorm
        )
    }
}

/// One injected fault.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FaultRecord {
    /// What.
    pub kind: FaultKind,
    /// Which process (generation name), replica or session.
    pub target: String,
    /// Injected at (µs).
    pub start: i64,
    /// Recovered at (µs): restart done, SIGCONT sent, connections reset.
    pub end: i64,
    /// Free text for the log.
    pub detail: String,
}

/// Every fault of the run, also appended to `faults.jsonl` as it happens.
pub struct Timeline {
    records: Mutex<Vec<FaultRecord>>,
    file: Mutex<File>,
}

impl Timeline {
    /// A timeline journaled to `path`.
    pub fn create(path: &Path) -> anyhow::Result<Self> {
        Ok(Self {
            records: Mutex::new(Vec::new()),
            file: Mutex::new(File::create(path)?),
        })
    }

    /// Records a fault once it is over.
    pub fn record(&self, record: FaultRecord) {
        if let Ok(line) = serde_json::to_string(&record) {
            let mut file = self.file.lock().unwrap_or_else(PoisonError::into_inner);
            let _ = writeln!(file, "{line}");
        }
        self.records
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(record);
    }

    /// Every recorded fault.
    pub fn all(&self) -> Vec<FaultRecord> {
        self.records
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}
