//! A worker's second session: after each OK it reads the intent back at once, so the
//! checker can tell an OK that arrived before its change was committed.

use std::sync::Arc;
use std::time::Duration;

use sqlx::{Connection, PgConnection};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::journal::{Event, Journal, Settle, now_us};

/// An OK to read back: `call` answered OK for `lease` on `intent`.
pub struct ReadBack {
    pub call: Settle,
    pub intent: Uuid,
    pub lease: Uuid,
}

/// A task reading back, in order, each OK sent to it, and journaling what it saw; once
/// `done` is cancelled it finishes what was queued and ends.
pub fn spawn(
    url: String,
    journal: Arc<Journal>,
    done: CancellationToken,
) -> (mpsc::UnboundedSender<ReadBack>, JoinHandle<()>) {
    let (sender, mut queue) = mpsc::unbounded_channel::<ReadBack>();
    let task = tokio::spawn(async move {
        let mut reader = CommitReader::new(url);
        loop {
            let next = tokio::select! {
                next = queue.recv() => next,
                () = done.cancelled() => queue.try_recv().ok(),
            };
            let Some(ok) = next else {
                return;
            };
            // Unreadable (PostgreSQL down): nothing to judge.
            if let Some(seen) = reader.read(ok.intent).await {
                journal.log(&Event::ReadBack {
                    t: now_us(),
                    intent: ok.intent,
                    lease: ok.lease,
                    call: ok.call,
                    committed: ok.call.committed(&seen, ok.lease),
                    seen: seen.state,
                });
            }
        }
    });
    (sender, task)
}

/// The intent as another session sees it.
pub struct Seen {
    /// Its state.
    pub state: String,
    /// Its current lease, if any.
    pub lease: Option<Uuid>,
}

/// One connection, opened on first use and again after it broke.
pub struct CommitReader {
    url: String,
    connection: Option<PgConnection>,
}

impl CommitReader {
    /// A reader of the database at `url` (a superuser's: every tenant's rows).
    pub fn new(url: String) -> Self {
        Self {
            url,
            connection: None,
        }
    }

    /// The intent `id` now, or None when the database cannot be read (it is down).
    pub async fn read(&mut self, id: Uuid) -> Option<Seen> {
        if self.connection.is_none() {
            let connect = PgConnection::connect(&self.url);
            self.connection = tokio::time::timeout(Duration::from_secs(2), connect)
                .await
                .ok()?
                .ok();
        }
        let connection = self.connection.as_mut()?;
        let read = sqlx::query_as::<_, (String, Option<Uuid>)>(
            "SELECT state::text, lease_id FROM outbox.intents_by_id(ARRAY[$1]::uuid[])",
        )
        .bind(id)
        .fetch_optional(&mut *connection);
        match tokio::time::timeout(Duration::from_secs(2), read).await {
            Ok(Ok(Some((state, lease)))) => Some(Seen { state, lease }),
            Ok(Ok(None)) => Some(Seen {
                state: "missing".to_owned(),
                lease: None,
            }),
            _ => {
                self.connection = None;
                None
            }
        }
    }
}

impl Settle {
    /// Whether `seen` shows the change this call, answered OK for `lease`, made: the
    /// intent no longer held under that lease in a state the call moves it out of.
    pub fn committed(self, seen: &Seen, lease: Uuid) -> bool {
        let before: &[&str] = match self {
            Self::MarkSubmitted => &["leased"],
            Self::Ack | Self::Fail => &["leased", "submitted"],
        };
        // A delivered intent may already be purged (retention zero); nothing else goes.
        let gone = seen.state == "missing";
        if gone {
            return self == Self::Ack;
        }
        !(seen.lease == Some(lease) && before.contains(&seen.state.as_str()))
    }
}
