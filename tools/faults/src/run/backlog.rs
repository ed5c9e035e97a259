//! The backlog of a second tenant, enqueued before any producer or worker starts, so that
//! every intent of the run's tenant is younger than all of it. The workers serve both
//! tenants; `checker::fairness` checks the run's tenant was not served after it.

use std::path::Path;
use std::time::Duration;

use outboxd::proto::v1;

use crate::NOTICE_KIND;
use crate::journal::Journal;
use crate::producer::direct_enqueued;
use crate::rpc::{CALL_TIMEOUT, Rpc, request};

/// Intents per Enqueue.
const BATCH: u64 = 500;

/// Enqueues `count` intents of the unlimited kind for the key's tenant, journaled as a
/// producer's direct enqueues (so the checker holds them to the same guarantees).
pub async fn seed(
    endpoints: &[String],
    key: &str,
    count: u64,
    journal: &Path,
) -> anyhow::Result<()> {
    let mut rpc = Rpc::new(endpoints, key, count)?;
    let journal = Journal::create(journal)?;
    let mut enqueued = 0;
    while enqueued < count {
        let batch = BATCH.min(count - enqueued);
        let intents = (enqueued..enqueued + batch)
            .map(|i| v1::NewIntent {
                kind: NOTICE_KIND.to_owned(),
                payload: format!(r#"{{"backlog":{i}}}"#).into_bytes(),
                content_type: "application/json".to_owned(),
                idempotency_key: format!("backlog/{i}"),
                max_attempts: 8,
                ..Default::default()
            })
            .collect();
        let message = v1::EnqueueRequest {
            intents,
            txn_token: String::new(),
        };
        let called = rpc
            .call(Duration::from_secs(30), |mut client| {
                let request = request(message.clone(), CALL_TIMEOUT);
                async move { client.enqueue(request).await }
            })
            .await
            .map_err(|e| anyhow::anyhow!(e.describe()))?;
        journal.log(&direct_enqueued(&called));
        enqueued += batch;
    }
    Ok(())
}
