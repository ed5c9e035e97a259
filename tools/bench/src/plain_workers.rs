//! Plain burn-down workers: each a closed loop of Claim(batch) → Ack(batch), no SDK and no
//! `request_id`, as the benchmark drove outboxd before its workers were the SDK's. For A/B
//! runs of a server build against an older one under the same load (`all --plain-workers`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use outboxd::proto::v1;
use tokio::task::JoinSet;

use crate::harness::connect_client;
use crate::report::Hist;

/// `workers` loops of `kind` ack intents until `total` are acked, or none was claimed for
/// 10 s. Returns the acked count and the Claim + Ack cycles.
pub async fn burn_down(
    endpoint: &str,
    key: &str,
    kind: &str,
    total: u64,
    workers: usize,
    batch: u32,
) -> anyhow::Result<(u64, Hist)> {
    let acked = Arc::new(AtomicU64::new(0));
    let mut loops = JoinSet::new();
    for w in 0..workers {
        let mut client = connect_client(endpoint, key).await?;
        let (acked, kind) = (acked.clone(), kind.to_owned());
        loops.spawn(async move {
            let mut cycles = Hist::new();
            let mut idle_since: Option<Instant> = None;
            loop {
                let started = Instant::now();
                let claim = v1::ClaimRequest {
                    worker_id: format!("plain-{w}"),
                    kinds: vec![kind.clone()],
                    max_intents: i32::try_from(batch).unwrap_or(i32::MAX),
                    ..Default::default()
                };
                let leases = client
                    .claim(claim)
                    .await
                    .context("Claim")?
                    .into_inner()
                    .leases;
                if leases.is_empty() {
                    // Others may still hold the last leases: look again shortly.
                    if acked.load(Ordering::Relaxed) >= total
                        || idle_since.get_or_insert(started).elapsed() > Duration::from_secs(10)
                    {
                        return anyhow::Ok(cycles);
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    continue;
                }
                idle_since = None;
                let refs = leases
                    .iter()
                    .map(|l| v1::LeaseRef {
                        intent_id: l.intent.as_ref().map(|i| i.id.clone()).unwrap_or_default(),
                        lease_id: l.lease_id.clone(),
                    })
                    .collect();
                let results = client
                    .ack(v1::AckRequest { leases: refs })
                    .await
                    .context("Ack")?
                    .into_inner()
                    .results;
                cycles.record(started.elapsed());
                // Per item: an Ack refused for one lease (lost meanwhile) acked nothing.
                let done = results.iter().filter(|r| r.error.is_none()).count();
                acked.fetch_add(done as u64, Ordering::Relaxed);
            }
        });
    }
    let mut cycles = Hist::new();
    while let Some(one) = loops.join_next().await {
        cycles.merge(&one??);
    }
    Ok((acked.load(Ordering::Relaxed), cycles))
}
