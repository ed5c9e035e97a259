//! What the suite's processes observed, as JSON lines: one file per producer or worker
//! process, written with one `write(2)` per event and no user-space buffer, so a SIGKILL
//! loses nothing the process had logged. The checker reads them back after the run.
//!
//! Times are microseconds since the Unix epoch from the machine's realtime clock, the same
//! clock PostgreSQL's `now()` reads, so client times and lease expiries compare directly.

use std::fs::{File, OpenOptions};
use std::io::{self, BufRead, BufReader, Write};
use std::path::Path;

use anyhow::Context;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// Microseconds since the Unix epoch, now.
pub fn now_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

/// Microseconds since the Unix epoch of a protobuf timestamp.
pub fn timestamp_us(t: &prost_types::Timestamp) -> i64 {
    t.seconds * 1_000_000 + i64::from(t.nanos) / 1_000
}

/// How a call that names a lease ended, as the client saw it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The server answered OK for the item.
    Ok,
    /// The server answered `LEASE_LOST` for the item: the lease was stale.
    LeaseLost,
    /// Another definite refusal (whole call or item), with its reason.
    Rejected(String),
    /// No definite answer within the retry budget (lost responses, servers down).
    Unknown(String),
}

/// How a worker failed an intent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailKind {
    /// The side effect did not happen; try again later.
    Retry,
    /// The side effect did not happen and never will.
    Permanent,
    /// Nobody knows whether it happened.
    Unknown,
}

/// A settle call whose OK a worker reads back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Settle {
    /// MarkSubmitted.
    MarkSubmitted,
    /// Ack.
    Ack,
    /// Fail.
    Fail,
}

/// One lease as a Claim returned it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LeaseSeen {
    /// The intent.
    pub intent: Uuid,
    /// The fencing token.
    pub lease: Uuid,
    /// Intent kind (decides whether the worker marks it submitted).
    pub kind: String,
    /// Attempt number the server counted for this claim.
    pub attempt: i32,
    /// `lease_expires_at`, in µs.
    pub expires: i64,
    /// State the intent was returned in.
    pub state: String,
    /// Leased by the Enqueue that inserted it, to a Claim waiting for it (the server's
    /// hand-off): its first lease was minted with the row (`updated_at == created_at`).
    #[serde(default)]
    pub handed_off: bool,
}

/// Everything the producers and workers record.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "ev", rename_all = "snake_case")]
pub enum Event {
    /// Producer: Enqueue with the transaction's token answered OK; the transaction is open.
    Staged {
        t: i64,
        order: i64,
        xid: String,
        intents: Vec<Uuid>,
        tries: u32,
        /// Intents the answer reported as deduplicated (a retry after a lost response).
        deduplicated: u32,
    },
    /// Producer: COMMIT is about to be sent.
    CommitSent { t: i64, order: i64 },
    /// Producer: COMMIT answered OK.
    Committed { t: i64, order: i64 },
    /// Producer: COMMIT failed (connection lost): the outcome is unknown to the producer.
    CommitFailed { t: i64, order: i64, error: String },
    /// Producer: the transaction was rolled back or died (`order` unknown if the INSERT failed).
    RolledBack {
        t: i64,
        order: Option<i64>,
        reason: String,
    },
    /// Producer: a direct Enqueue answered OK.
    DirectEnqueued {
        t: i64,
        intents: Vec<Uuid>,
        tries: u32,
        /// Intents the answer reported as deduplicated (a retry after a lost response).
        deduplicated: u32,
    },
    /// Producer: a direct Enqueue never got a definite answer, or was refused.
    DirectUnknown {
        t: i64,
        keys: Vec<String>,
        error: String,
    },
    /// Worker: a Claim call answered (logged when it leased something or needed retries).
    Claimed {
        t: i64,
        /// None for a long poll without one (an enqueue may hand it intents; a lost
        /// answer's leases expire).
        request: Option<Uuid>,
        duration_ms: i64,
        tries: u32,
        errors: Vec<String>,
        /// When the answered attempt was sent.
        last_try: i64,
        leases: Vec<LeaseSeen>,
    },
    /// Worker: MarkSubmitted is about to be sent.
    MarkSent { t: i64, intent: Uuid, lease: Uuid },
    /// Worker: MarkSubmitted's outcome.
    Marked {
        t: i64,
        intent: Uuid,
        lease: Uuid,
        result: Outcome,
        tries: u32,
    },
    /// Worker: a heartbeat's ExtendLease outcome and the new expiry (the checker trusts
    /// only an extension the server answered OK, since an unanswered one may as well have
    /// been refused).
    Extended {
        t: i64,
        intent: Uuid,
        lease: Uuid,
        result: Outcome,
        expires: Option<i64>,
    },
    /// Worker: the intent read back from another session right after `call` was answered
    /// OK; `committed` is false when the row still shows the state before the call.
    ReadBack {
        t: i64,
        intent: Uuid,
        lease: Uuid,
        call: Settle,
        seen: String,
        committed: bool,
    },
    /// Worker: the SDK found the lease lost (a call answered that it is not ours, or it
    /// expired before a heartbeat got through): the handler was cancelled and nothing more
    /// is reported for it.
    LeaseLost {
        t: i64,
        intent: Uuid,
        lease: Uuid,
        why: String,
    },
    /// Worker: the side effect was performed (logged before the Ack is sent).
    Performed {
        t: i64,
        intent: Uuid,
        lease: Uuid,
        attempt: i32,
    },
    /// Worker: Ack is about to be sent.
    AckSent { t: i64, intent: Uuid, lease: Uuid },
    /// Worker: Ack's outcome.
    Acked {
        t: i64,
        intent: Uuid,
        lease: Uuid,
        result: Outcome,
        tries: u32,
        errors: Vec<String>,
        /// Replica (0-based) that answered, and how long the answered attempt took (µs).
        #[serde(default)]
        via: Option<(usize, i64)>,
    },
    /// Worker: Fail is about to be sent.
    FailSent {
        t: i64,
        intent: Uuid,
        lease: Uuid,
        outcome: FailKind,
    },
    /// Worker: Fail's outcome.
    Failed {
        t: i64,
        intent: Uuid,
        lease: Uuid,
        outcome: FailKind,
        result: Outcome,
        tries: u32,
    },
}

/// An append-only JSON-lines file.
#[derive(Debug)]
pub struct Journal {
    file: File,
}

impl Journal {
    /// Creates (or appends to) `path`.
    pub fn create(path: &Path) -> anyhow::Result<Self> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("opening {}", path.display()))?;
        Ok(Self { file })
    }

    /// Appends one event as one line, in one write.
    pub fn log(&self, event: &Event) {
        let mut line = serde_json::to_vec(event).expect("events serialize");
        line.push(b'\n');
        // An observation that cannot be written would make the checks lie: stop here.
        (&self.file)
            .write_all(&line)
            .expect("writing the journal failed");
    }
}

/// Reads every event of a journal. A torn last line (a process killed inside `write`) is
/// ignored; a malformed line anywhere else is an error.
pub fn read(path: &Path) -> anyhow::Result<Vec<Event>> {
    let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let lines: Vec<String> = BufReader::new(file)
        .lines()
        .collect::<io::Result<_>>()
        .with_context(|| format!("reading {}", path.display()))?;
    let mut events = Vec::with_capacity(lines.len());
    for (i, line) in lines.iter().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str(line) {
            Ok(event) => events.push(event),
            Err(_) if i + 1 == lines.len() => {}
            Err(e) => {
                return Err(e).with_context(|| format!("{}:{}", path.display(), i + 1));
            }
        }
    }
    Ok(events)
}
