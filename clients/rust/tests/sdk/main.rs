//! The SDK against real outboxd servers on a real PostgreSQL cluster (`harness`): the
//! producer's transactions, the worker loop, failover and the drain. No mocked server; every
//! wait polls a condition against a deadline.

mod claim_batch;
mod connection;
mod harness;
mod observer;
mod producer;
mod proxy;
#[cfg(feature = "otel")]
mod trace;
mod worker;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use outboxd_client::{CallOptions, Connection, Error, NewIntent, Outbox, Worker, proto};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// A worker running on a task of its own until `stop`.
pub struct Running {
    /// The worker (a clone of the running one: its stats are the running one's).
    pub worker: Worker,
    stop: CancellationToken,
    handle: JoinHandle<Result<(), Error>>,
}

impl Running {
    /// Runs `worker` on a task of its own.
    pub fn start(worker: Worker) -> Self {
        let stop = CancellationToken::new();
        let handle = tokio::spawn({
            let worker = worker.clone();
            let stop = stop.clone();
            async move { worker.run_until(stop.cancelled_owned()).await }
        });
        Self {
            worker,
            stop,
            handle,
        }
    }

    /// Waits (up to `timeout`) until the worker has acked at least `n` leases.
    pub async fn acked(&self, n: u64, timeout: Duration) {
        harness::wait_for(&format!("{n} acks"), timeout, || {
            (self.worker.stats().acked >= n).then_some(())
        })
        .await;
    }

    /// Begins the drain without waiting for it.
    pub fn begin_stop(&self) {
        self.stop.cancel();
    }

    /// True once `run_until` returned.
    pub fn is_finished(&self) -> bool {
        self.handle.is_finished()
    }

    /// Drains; the worker's result.
    pub async fn stop(self) -> Result<(), Error> {
        self.stop.cancel();
        tokio::time::timeout(Duration::from_secs(60), self.handle)
            .await
            .expect("the worker drained within 60 s")
            .expect("the worker task")
    }

    /// Aborts the worker's task: a crash (no drain, no settles).
    pub async fn crash(self) {
        self.handle.abort();
        let _ = self.handle.await;
    }
}

/// A latch that handlers wait on until the test opens it (after which they pass at once).
#[derive(Clone, Default)]
pub struct Gate(Arc<(Notify, AtomicBool)>);

impl Gate {
    pub async fn wait(&self) {
        let (notify, open) = &*self.0;
        // Made before the check: an `open` in between still wakes it.
        let notified = notify.notified();
        if !open.load(Ordering::SeqCst) {
            notified.await;
        }
    }

    pub fn open(&self) {
        let (notify, open) = &*self.0;
        open.store(true, Ordering::SeqCst);
        notify.notify_waiters();
    }
}

/// Enqueues `n` intents of `kind` directly (batches of 1,000); returns their ids.
pub async fn enqueue(outbox: &Outbox, kind: &str, n: usize, size: usize) -> Vec<String> {
    let mut ids = Vec::with_capacity(n);
    let mut start = 0;
    while start < n {
        let end = (start + 1000).min(n);
        let batch = (start..end).map(|i| {
            let payload = if size > 0 {
                vec![b'x'; size]
            } else {
                i.to_string().into_bytes()
            };
            NewIntent::new(kind, payload)
        });
        let results = outbox.enqueue_direct_many(batch).await.expect("enqueue");
        ids.extend(results.into_iter().map(|r| r.id));
        start = end;
    }
    ids
}

/// Every intent of `kind` (ListIntents, paged).
pub async fn list(connection: &Connection, kind: &str) -> Vec<proto::Intent> {
    let mut intents = Vec::new();
    let mut token = String::new();
    loop {
        let request = proto::ListIntentsRequest {
            kind: kind.to_owned(),
            page_size: 1000,
            page_token: token.clone(),
            ..Default::default()
        };
        let page = connection
            .call(CallOptions::new(Duration::from_secs(10)), |mut client| {
                let request = request.clone();
                async move { client.list_intents(request).await }
            })
            .await
            .expect("ListIntents");
        intents.extend(page.intents);
        if page.next_page_token.is_empty() {
            return intents;
        }
        token = page.next_page_token;
    }
}
