//! The failover scenario's workers: `outboxd-client`'s managed worker on both replicas,
//! acking each intent at once. Its observer records what the checks need: each intent a
//! Claim returned, each Ack answered OK (and when), and every error answer.

use std::sync::Arc;
use std::time::Duration;

use outboxd_client::{
    Answer, ClaimEvent, Connection, Failure, Job, LeaseCall, LeaseId, Worker, WorkerObserver,
};
use tokio_util::sync::CancellationToken;

use super::{EVENT_KIND, SENTINEL_KIND, Shared, TENANT};
use crate::rpc::CALL_TIMEOUT;

/// Records into the scenario's `Seen`.
struct Recorder(Arc<Shared>);

impl WorkerObserver for Recorder {
    fn claimed(&self, claim: &ClaimEvent<'_>) {
        for status in &claim.attempts.retried {
            self.0.record_error(status);
        }
        let mut seen = self.0.seen();
        for lease in claim.leases {
            if let Some(id) = lease.intent.as_ref().and_then(|i| i.id.parse().ok()) {
                seen.claimed.insert(id);
            }
        }
    }

    fn answered(&self, lease: LeaseId<'_>, call: LeaseCall, answer: &Answer<'_>) {
        for status in &answer.attempts.retried {
            self.0.record_error(status);
        }
        if let Some(status) = answer.result.err().and_then(|e| e.status()) {
            self.0.record_error(status);
        }
        if call == LeaseCall::Ack
            && answer.is_ok()
            && let Ok(id) = lease.intent_id.parse()
        {
            let at = self.0.now();
            self.0.seen().acked.push((id, at));
        }
    }
}

/// Every intent is acked at once.
async fn ack(_job: Job) -> Result<(), Failure> {
    Ok(())
}

/// One worker on `endpoints` (it starts on the first), until `stop`, then its drain.
pub(super) async fn work(
    shared: Arc<Shared>,
    endpoints: Vec<String>,
    key: String,
    stop: CancellationToken,
) {
    let worker = Connection::builder(endpoints)
        .api_key(key)
        .tenant(TENANT)
        .connect_timeout(Duration::from_secs(1))
        .call_timeout(CALL_TIMEOUT)
        .build()
        .and_then(|connection| {
            Worker::builder(connection)
                .worker_id("failover")
                .kinds(Vec::<String>::new())
                .concurrency(20)
                .lease(Duration::from_secs(3))
                .claim_wait(Duration::from_millis(500))
                .observer(Recorder(shared.clone()))
                .handler(EVENT_KIND, ack)
                .handler(SENTINEL_KIND, ack)
                .build()
        });
    let result = match worker {
        Ok(worker) => worker.run_until(stop.cancelled()).await,
        Err(error) => Err(error),
    };
    // A Claim refused for good ends the worker: its error is an answer too.
    if let Some(status) = result.err().as_ref().and_then(|e| e.status()) {
        shared.record_error(status);
    }
}
