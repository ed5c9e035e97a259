//! The cancel storm: clients that give up on calls of every kind 1 to 4 ms in (their
//! deadline passes, they disconnect), against every replica while the load runs. Nothing
//! they did may leave a trace: the workers' read-backs of every OK and the checks after the
//! drain judge the storm like any other fault.

use std::time::Duration;

use outboxd::client::{Client, Credentials, client};
use outboxd::proto::v1;
use tokio::time::Instant;
use tonic::transport::Channel;
use uuid::Uuid;

use crate::cluster::Keys;
use crate::rng::Rng;

/// Callers per storm, each on connections of its own (hyper closes a connection whose
/// client resets streams this fast, so one client per caller and role).
const CALLERS: u64 = 4;

/// Calls made, for the timeline.
#[derive(Debug, Default)]
pub struct Storm {
    /// Calls sent.
    pub calls: u64,
    /// Of those, answered before their caller gave up.
    pub answered: u64,
}

/// Storms `endpoints` for `how_long`.
pub async fn storm(endpoints: &[String], keys: &Keys, how_long: Duration, seed: u64) -> Storm {
    let end = Instant::now() + how_long;
    let mut callers = Vec::new();
    for c in 0..CALLERS {
        let endpoint = endpoints[(c as usize) % endpoints.len()].clone();
        let keys = keys.clone();
        callers.push(tokio::spawn(async move {
            caller(&endpoint, &keys, end, Rng::new(seed ^ c.rotate_left(29)), c).await
        }));
    }
    let mut total = Storm::default();
    for caller in callers {
        if let Ok(storm) = caller.await {
            total.calls += storm.calls;
            total.answered += storm.answered;
        }
    }
    total
}

/// Clients of one endpoint with the worker's and the operator's keys.
fn clients(endpoint: &str, keys: &Keys) -> Option<(Client, Client)> {
    let channel = || {
        Channel::from_shared(format!("http://{endpoint}"))
            .ok()
            .map(|c| c.connect_lazy())
    };
    let credentials = |key: &str| Credentials::new(Some(key), None).ok();
    Some((
        client(channel()?, credentials(&keys.worker)?),
        client(channel()?, credentials(&keys.operator)?),
    ))
}

async fn caller(endpoint: &str, keys: &Keys, end: Instant, mut rng: Rng, n: u64) -> Storm {
    let mut storm = Storm::default();
    let Some((worker, operator)) = clients(endpoint, keys) else {
        return storm;
    };
    // Intents that exist, so that settles on them with made-up leases reach the database.
    let mut known: Vec<String> = Vec::new();
    while Instant::now() < end {
        if known.is_empty() || rng.chance(0.02) {
            known = live_intents(operator.clone()).await;
        }
        let id = if known.is_empty() {
            Uuid::now_v7().to_string()
        } else {
            rng.pick(&known).clone()
        };
        let stale = v1::LeaseRef {
            intent_id: id.clone(),
            lease_id: Uuid::now_v7().to_string(),
        };
        let give_up_after = rng.millis(1, 4);
        let (mut w, mut o) = (worker.clone(), operator.clone());
        let call = async {
            match rng.below(10) {
                0 | 1 => {
                    let request = v1::ClaimRequest {
                        worker_id: format!("storm-{n}"),
                        max_intents: 1 + rng.below(3) as i32,
                        lease_duration: Some(prost_types::Duration {
                            seconds: 1,
                            nanos: 0,
                        }),
                        wait: rng.chance(0.5).then_some(prost_types::Duration {
                            seconds: 1,
                            nanos: 0,
                        }),
                        request_id: if rng.chance(0.5) {
                            Uuid::new_v4().to_string()
                        } else {
                            String::new()
                        },
                        ..Default::default()
                    };
                    w.claim(request).await.map(drop)
                }
                2 => {
                    let leases = vec![stale];
                    w.ack(v1::AckRequest { leases }).await.map(drop)
                }
                3 => {
                    let leases = vec![stale];
                    let request = v1::MarkSubmittedRequest { leases };
                    w.mark_submitted(request).await.map(drop)
                }
                4 => {
                    let failures = vec![v1::Failure {
                        lease: Some(stale),
                        error: "storm".into(),
                        outcome: v1::FailOutcome::Retry as i32,
                        retry_after: None,
                    }];
                    w.fail(v1::FailRequest { failures }).await.map(drop)
                }
                5 => {
                    let request = v1::ExtendLeaseRequest {
                        leases: vec![stale],
                        lease_duration: None,
                    };
                    w.extend_lease(request).await.map(drop)
                }
                6 => o.get_intent(v1::GetIntentRequest { id }).await.map(drop),
                7 => {
                    let request = v1::ListIntentsRequest {
                        page_size: 50,
                        ..Default::default()
                    };
                    o.list_intents(request).await.map(drop)
                }
                8 => {
                    let request = v1::GetQueueStatsRequest::default();
                    o.get_queue_stats(request).await.map(drop)
                }
                _ => {
                    // Ids nobody has: every item NOT_FOUND, nothing resolved.
                    let ids = vec![Uuid::now_v7().to_string()];
                    let request = v1::ReconcileRequest {
                        target: Some(v1::reconcile_request::Target::Ids(v1::ReconcileIds {
                            ids,
                            ..Default::default()
                        })),
                        decision: v1::Decision::Delivered as i32,
                        actor: "storm".into(),
                        reason: "made-up id".into(),
                        ..Default::default()
                    };
                    o.reconcile(request).await.map(drop)
                }
            }
        };
        storm.calls += 1;
        if let Ok(Ok(())) = tokio::time::timeout(give_up_after, call).await {
            storm.answered += 1;
        }
    }
    storm
}

/// Ids of intents that are LEASED or SUBMITTED now (empty when the call fails).
async fn live_intents(mut operator: Client) -> Vec<String> {
    let request = v1::ListIntentsRequest {
        states: vec![
            v1::IntentState::Leased as i32,
            v1::IntentState::Submitted as i32,
        ],
        page_size: 100,
        ..Default::default()
    };
    let listed = tokio::time::timeout(Duration::from_secs(2), operator.list_intents(request));
    match listed.await {
        Ok(Ok(page)) => page
            .into_inner()
            .intents
            .into_iter()
            .map(|i| i.id)
            .collect(),
        _ => Vec::new(),
    }
}
