//! Claim: batches, order, leases, regions, kinds, request-id replays and concurrency.

use std::collections::HashSet;
use std::time::Duration;

use outboxd::proto::v1;
use tonic::Code;

use crate::helpers::{
    TENANT, TestApp, assert_item_ok, assert_status, claim_request, duration, id_of, intent, secs,
};

#[tokio::test]
async fn claim_returns_nothing_when_the_outbox_is_empty() {
    let app = TestApp::spawn().await;
    assert!(app.claim_n("w", 10).await.is_empty());
}

#[tokio::test]
async fn claim_leases_oldest_first_counts_the_attempt_and_mints_a_fresh_lease() {
    let app = TestApp::spawn().await;
    let ids = app.enqueue_n("job", 5).await;
    let mut request = claim_request("worker-1", 3);
    request.lease_duration = Some(duration(Duration::from_secs(45)));
    let leases = app.claim(request).await.unwrap();

    assert_eq!(
        leases.iter().map(id_of).collect::<Vec<_>>(),
        ids[..3].iter().map(String::as_str).collect::<Vec<_>>()
    );
    let now = app.clock.now().unwrap();
    for lease in &leases {
        assert_eq!(lease.attempt, 1);
        assert!(uuid::Uuid::parse_str(&lease.lease_id).is_ok());
        let expires = secs(&lease.lease_expires_at);
        assert!((expires - (now.timestamp_micros() as f64 / 1e6 + 45.0)).abs() < 0.001);
        let intent = lease.intent.as_ref().unwrap();
        assert_eq!(intent.state(), v1::IntentState::Leased);
        assert_eq!(intent.worker_id, "worker-1");
        assert!(!intent.payload.is_empty(), "the worker gets the payload");
    }
    let distinct: HashSet<_> = leases.iter().map(|l| l.lease_id.clone()).collect();
    assert_eq!(distinct.len(), 3);

    let rest = app.claim_n("worker-2", 10).await;
    assert_eq!(
        rest.iter().map(id_of).collect::<Vec<_>>(),
        vec![ids[3].as_str(), ids[4].as_str()]
    );
}

/// gRPC clients refuse a reply over 4 MiB by default: a Claim whose leases would pass the
/// server's reply limit (that, by default) answers with those that fit, and the rest go back
/// to PENDING uncounted. Before, the client refused the reply after its leases committed,
/// and each retry cost the intents an attempt no worker saw, until they were dead-lettered.
#[tokio::test]
async fn a_claim_too_large_for_one_reply_answers_with_what_fits_and_gives_the_rest_back_uncounted()
{
    let app = TestApp::spawn().await;
    let ids = app.enqueue_largest_payloads(5).await;

    let first = app
        .claim(claim_request("w1", 5))
        .await
        .expect("a reply the default client accepts");
    assert_eq!(
        first.iter().map(id_of).collect::<Vec<_>>(),
        ids[..3].iter().map(String::as_str).collect::<Vec<_>>(),
        "three leases of 1 MiB fit in 4 MiB, a fourth would not"
    );
    for id in &ids[3..] {
        app.wait_for_state(id, v1::IntentState::Pending).await;
    }
    let rest = app.claim_n("w2", 5).await;
    assert_eq!(
        rest.iter().map(id_of).collect::<Vec<_>>(),
        ids[3..].iter().map(String::as_str).collect::<Vec<_>>()
    );
    for lease in &rest {
        assert_eq!(
            lease.attempt, 1,
            "the claim that gave it back did not count"
        );
    }
}

#[tokio::test]
async fn a_regional_worker_gets_its_region_and_regionless_intents_only() {
    let app = TestApp::spawn().await;
    let mut eu = intent("job", "eu");
    eu.region = "eu".into();
    let mut us = intent("job", "us");
    us.region = "us".into();
    let anywhere = intent("job", "any");
    app.enqueue(vec![eu, us, anywhere]).await.unwrap();

    let mut request = claim_request("eu-worker", 10);
    request.region = "eu".into();
    let leases = app.claim(request).await.unwrap();
    let payloads: HashSet<Vec<u8>> = leases
        .iter()
        .map(|l| l.intent.as_ref().unwrap().payload.clone())
        .collect();
    assert_eq!(payloads, HashSet::from([b"eu".to_vec(), b"any".to_vec()]));

    let rest = app.claim_n("global-worker", 10).await;
    assert_eq!(rest.len(), 1);
    assert_eq!(
        rest[0].intent.as_ref().unwrap().region,
        "us",
        "a worker without region takes any"
    );
}

#[tokio::test]
async fn a_kinds_filter_leases_only_those_kinds() {
    let app = TestApp::spawn().await;
    app.enqueue(vec![
        intent("email", "{}"),
        intent("sms", "{}"),
        intent("push", "{}"),
    ])
    .await
    .unwrap();
    let mut request = claim_request("w", 10);
    request.kinds = vec!["sms".into(), "push".into()];
    let kinds: HashSet<String> = app
        .claim(request)
        .await
        .unwrap()
        .iter()
        .map(|l| l.intent.as_ref().unwrap().kind.clone())
        .collect();
    assert_eq!(kinds, HashSet::from(["sms".to_owned(), "push".to_owned()]));
}

#[tokio::test]
async fn retrying_a_claim_with_the_same_request_id_returns_the_same_leases() {
    let app = TestApp::spawn().await;
    app.enqueue_n("job", 6).await;
    let mut request = claim_request("w", 2);
    request.request_id = "req-1".into();
    let first = app.claim(request.clone()).await.unwrap();
    let replay = app.claim(request.clone()).await.unwrap();
    assert_eq!(first.len(), 2);
    assert_eq!(
        first
            .iter()
            .map(|l| (&l.lease_id, l.attempt))
            .collect::<Vec<_>>(),
        replay
            .iter()
            .map(|l| (&l.lease_id, l.attempt))
            .collect::<Vec<_>>()
    );

    // Another consume key of the tenant naming the same worker and request id: a claim of
    // its own, not a replay of those leases (which it could then settle).
    let other_key = app.key(&[TENANT], &["consume"], &[]).await;
    let mut other = app.client_with(Some(&other_key), None).await;
    let not_theirs = other
        .claim(request.clone())
        .await
        .unwrap()
        .into_inner()
        .leases;
    assert!(
        not_theirs
            .iter()
            .all(|l| !first.iter().any(|f| f.lease_id == l.lease_id)),
        "a replay is bound to the API key of the first claim"
    );
    app.enqueue_n("job", not_theirs.len()).await;

    let mut other_worker = request.clone();
    other_worker.worker_id = "w2".into();
    let theirs = app.claim(other_worker).await.unwrap();
    assert_eq!(theirs.len(), 2, "request ids are scoped to the worker");
    assert!(
        theirs
            .iter()
            .all(|l| !first.iter().any(|f| f.lease_id == l.lease_id))
    );

    let mut other_kinds = request.clone();
    other_kinds.kinds = vec!["report".into()];
    assert!(
        app.claim(other_kinds).await.unwrap().is_empty(),
        "a replay answers only the leases its own filters take"
    );

    let mut next = request;
    next.request_id = "req-2".into();
    assert_eq!(
        app.claim(next).await.unwrap().len(),
        2,
        "a new request id leases more"
    );
}

#[tokio::test]
async fn a_claims_replay_record_is_kept_for_its_lease_duration_then_forgotten() {
    let app = TestApp::spawn().await;
    app.enqueue_n("job", 2).await;
    let mut request = claim_request("w", 2);
    request.request_id = "req-1".into();
    request.lease_duration = Some(duration(Duration::from_secs(30)));
    let first = app.claim(request.clone()).await.unwrap();
    let mut fleet = app.fleet_connection().await;
    let records = "SELECT count(*) FROM outbox.claim_request";
    let kept: i64 = sqlx::query_scalar(records)
        .fetch_one(&mut fleet)
        .await
        .unwrap();
    assert_eq!(kept, 1, "one record for the claim, not one per intent");

    app.advance(Duration::from_secs(29));
    app.rescue().await;
    let replay = app.claim(request.clone()).await.unwrap();
    assert_eq!(
        replay.iter().map(|l| &l.lease_id).collect::<Vec<_>>(),
        first.iter().map(|l| &l.lease_id).collect::<Vec<_>>(),
        "replayed within the lease duration"
    );

    app.advance(Duration::from_secs(2));
    app.rescue().await;
    let kept: i64 = sqlx::query_scalar(records)
        .fetch_one(&mut fleet)
        .await
        .unwrap();
    assert_eq!(kept, 0, "forgotten with the expired leases");
    app.advance(Duration::from_secs(2)); // past the rescued intents' backoff
    let anew = app.claim(request).await.unwrap();
    assert_eq!(anew.len(), 2, "a retry after it leases anew");
    assert!(
        anew.iter()
            .all(|l| !first.iter().any(|f| f.lease_id == l.lease_id))
    );
}

#[tokio::test]
async fn a_replay_answers_only_the_leases_not_yet_expired() {
    let app = TestApp::spawn().await;
    app.enqueue_n("job", 2).await;
    let mut request = claim_request("w", 2);
    request.request_id = "req-1".into();
    request.lease_duration = Some(duration(Duration::from_secs(30)));
    let first = app.claim(request.clone()).await.unwrap();
    assert_eq!(first.len(), 2);
    // One lease extended, the other left to expire; the rescue has not come yet, so both
    // are still LEASED in the table.
    let extended = app.extend(&[&first[0]], Duration::from_secs(60)).await;
    assert!(extended[0].error.is_none(), "{extended:?}");
    app.advance(Duration::from_secs(31));
    let replay = app.claim(request.clone()).await.unwrap();
    assert_eq!(
        replay.iter().map(|l| &l.lease_id).collect::<Vec<_>>(),
        [&first[0].lease_id],
        "the expired lease may be rescued and leased again at any moment"
    );
    // The rescue takes the expired one back: claimable again, once.
    app.rescue().await;
    app.advance(Duration::from_secs(2)); // past its backoff
    let other = app.claim_n("other", 2).await;
    assert_eq!(other.len(), 1);
    assert_eq!(id_of(&other[0]), id_of(&first[1]));
}

#[tokio::test]
async fn a_replay_whose_leases_all_expired_is_a_claim_of_its_own() {
    let app = TestApp::spawn().await;
    let taken = app.enqueue_n("job", 2).await;
    let mut request = claim_request("w", 2);
    request.request_id = "req-1".into();
    request.lease_duration = Some(duration(Duration::from_secs(30)));
    let first = app.claim(request.clone()).await.unwrap();
    assert_eq!(first.len(), 2);
    let later = app.enqueue_n("job", 1).await;
    // Both leases expired; the rescue has not come yet.
    app.advance(Duration::from_secs(31));
    let retry = app.claim(request).await.unwrap();
    assert_eq!(
        retry.iter().map(id_of).collect::<Vec<_>>(),
        [later[0].as_str()],
        "the retry leases anew, never the expired leases of {taken:?}"
    );
}

#[tokio::test]
async fn a_claim_retried_under_a_narrower_tenant_scope_is_a_claim_of_its_own() {
    let app = TestApp::spawn().await;
    let key = app.key(&["a", "b"], &["produce", "consume"], &[]).await;
    for tenant in ["a", "b"] {
        let mut producer = app.client_with(Some(&key), Some(tenant)).await;
        producer
            .enqueue(v1::EnqueueRequest {
                intents: (0..2).map(|_| intent("job", "{}")).collect(),
                ..Default::default()
            })
            .await
            .unwrap();
    }
    let mut request = claim_request("w", 2);
    request.request_id = "req-1".into();
    let mut both = app.client_with(Some(&key), None).await;
    let first = both
        .claim(request.clone())
        .await
        .unwrap()
        .into_inner()
        .leases;
    assert_eq!(first.len(), 2);

    // Its first attempt's record names both tenants, which this scope may not see.
    let mut only_a = app.client_with(Some(&key), Some("a")).await;
    let retried = only_a.claim(request).await.unwrap().into_inner().leases;
    assert!(
        retried
            .iter()
            .all(|l| !first.iter().any(|f| f.lease_id == l.lease_id)),
        "a claim of its own, not a replay"
    );
}

#[tokio::test]
async fn a_retry_with_other_kinds_leases_anew_and_the_first_kinds_still_replay() {
    let app = TestApp::spawn().await;
    app.enqueue_n("sms", 2).await;
    app.enqueue_n("push", 2).await;
    let mut sms = claim_request("w", 2);
    sms.request_id = "req-1".into();
    sms.kinds = vec!["sms".into()];
    let first = app.claim(sms.clone()).await.unwrap();
    assert_eq!(first.len(), 2);

    let mut push = sms.clone();
    push.kinds = vec!["push".into()];
    let other = app.claim(push).await.unwrap();
    assert_eq!(
        other.len(),
        2,
        "none of the first leases is a push: it leases anew"
    );

    let replay = app.claim(sms).await.unwrap();
    assert_eq!(
        replay.iter().map(|l| &l.lease_id).collect::<Vec<_>>(),
        first.iter().map(|l| &l.lease_id).collect::<Vec<_>>(),
        "the first attempt's leases are still its replay"
    );
}

#[tokio::test]
async fn invalid_claims_are_rejected_with_the_fields_named() {
    let app = TestApp::spawn().await;
    let status = app
        .claim(v1::ClaimRequest {
            worker_id: String::new(),
            region: "bad region".into(),
            kinds: vec!["".into()],
            max_intents: 0,
            lease_duration: Some(duration(Duration::from_secs(100 * 3600))),
            wait: Some(duration(Duration::from_secs(3600))),
            request_id: String::new(),
        })
        .await
        .unwrap_err();
    assert_status(
        &status,
        Code::InvalidArgument,
        "INVALID_ARGUMENT",
        &[
            "worker_id",
            "region",
            "kinds[0]",
            "max_intents",
            "lease_duration",
            "wait",
        ],
    );
    let status = app.claim(claim_request("w", 100_000)).await.unwrap_err();
    assert_status(
        &status,
        Code::ResourceExhausted,
        "BATCH_TOO_LARGE",
        &["max_intents"],
    );
}

#[tokio::test]
async fn concurrent_claimers_get_disjoint_batches_and_every_intent_is_delivered_once() {
    let app = TestApp::spawn().await;
    let total = 400;
    for _ in 0..4 {
        app.enqueue_n("job", total / 4).await;
    }
    let workers: Vec<_> = (0..8)
        .map(|w| {
            let app_client = app.client();
            tokio::spawn(async move {
                let mut client = app_client;
                let mut delivered = Vec::new();
                loop {
                    let leases = client
                        .claim(claim_request(&format!("worker-{w}"), 7))
                        .await
                        .unwrap()
                        .into_inner()
                        .leases;
                    if leases.is_empty() {
                        return delivered;
                    }
                    let results = client
                        .ack(v1::AckRequest {
                            leases: leases.iter().map(crate::helpers::lease_ref).collect(),
                        })
                        .await
                        .unwrap()
                        .into_inner()
                        .results;
                    for r in &results {
                        assert_item_ok(r, v1::IntentState::Delivered);
                    }
                    delivered.extend(leases.iter().map(|l| id_of(l).to_owned()));
                }
            })
        })
        .collect();
    let mut all = Vec::new();
    for w in workers {
        all.extend(w.await.unwrap());
    }
    let distinct: HashSet<_> = all.iter().cloned().collect();
    assert_eq!(all.len(), total, "each intent was leased exactly once");
    assert_eq!(distinct.len(), total);
    let attempts: Vec<i32> = sqlx::query_scalar(
        "SELECT DISTINCT attempts FROM outbox.all_intents WHERE state = 'delivered'",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(attempts, vec![1]);
}

#[tokio::test]
async fn an_intent_that_becomes_claimable_behind_the_newest_one_claimed_is_still_claimed() {
    // Claims look from a floor just behind the newest intent their group took; an intent
    // available long before it (as one whose transaction took an hour to commit) is found
    // by a later look at the whole queue.
    let app = TestApp::spawn().await;
    let first = app.enqueue_one("job", "{}").await;
    let leases = app.claim_n("w", 10).await;
    assert_eq!(
        leases.iter().map(id_of).collect::<Vec<_>>(),
        vec![first.as_str()]
    );

    let old = app.insert_by_sql("job").await;
    sqlx::query(
        "UPDATE outbox.intent SET available_at = available_at - interval '1 hour' WHERE id = $1::uuid",
    )
    .bind(&old)
    .execute(&app.pool)
    .await
    .unwrap();

    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let leases = app.claim_n("w", 10).await;
        if !leases.is_empty() {
            assert_eq!(
                leases.iter().map(id_of).collect::<Vec<_>>(),
                vec![old.as_str()]
            );
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the intent behind the floor was not claimed within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn in_a_backlog_older_than_the_look_back_a_claim_takes_the_rest_and_what_was_enqueued_meanwhile()
 {
    // In a backlog older than the floor's look-back, the floor is the newest intent taken
    // (not a second behind it): what is left of the backlog, and what became PENDING after
    // that claim began, are both at or after it, and the next claim takes them at once.
    let app = TestApp::spawn().await;
    let backlog = app.enqueue_n("job", 3).await;
    app.advance(Duration::from_secs(3600));
    let first = app.claim_n("w", 1).await;
    assert_eq!(
        first.iter().map(id_of).collect::<Vec<_>>(),
        vec![backlog[0].as_str()]
    );

    let meanwhile = app.enqueue_one("job", "{}").await;
    let rest = app.claim_ids("w", 10).await;
    assert_eq!(
        rest,
        vec![backlog[1].clone(), backlog[2].clone(), meanwhile],
        "the rest of the backlog, oldest first, then the new intent"
    );
}
