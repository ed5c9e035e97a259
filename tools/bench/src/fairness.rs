//! Flow control. Tenant fairness: a small tenant enqueues at a slow fixed rate while
//! workers serving both tenants burn down another tenant's large backlog; the small
//! tenant's enqueue OK → claim latency, and the backlog's rate meanwhile. And the
//! burn-down with a concurrency limit on its kind.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use outboxd::proto::v1;
use outboxd::startup;
use sqlx::PgConnection;

use crate::harness::{Cluster, TENANT, connect_client};
use crate::meter::Meter;
use crate::ordered::fill;
use crate::report::{Hist, Outcome, Row};
use crate::suite::{
    Section, Sizes, THROUGHPUT_KIND, analyze, burn_down_name, new_intent, outboxd_burn_down,
    prepare_outbox,
};
use crate::txn_latency::signed_ms;
use crate::workers::{Shape, Workers};

/// The small tenant's rate, intents per second.
const SMALL_RATE: u32 = 10;

/// The tenant that enqueues at [`SMALL_RATE`].
const SMALL_TENANT: &str = "bench-small";

/// How long the small tenant's last intents may take to be claimed.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// Scenario key of the rows.
const KEY: &str = "fairness";

/// The fairness scenario's rows: the small tenant's latency, and the backlog's rate.
pub async fn fairness(
    cluster: &Cluster,
    admin: &mut PgConnection,
    database: &str,
    meter: &Meter,
    sizes: &Sizes,
    rows: &mut Vec<Row>,
) -> anyhow::Result<()> {
    let backlog = sizes.fairness_backlog;
    let target = prepare_outbox(cluster, admin, database).await?;
    eprintln!("outboxd-bench: outboxd filling a backlog of {backlog} for tenant {TENANT}");
    fill(&target, backlog, sizes.batch_clients, Arc::new(new_intent)).await?;
    let owner = startup::connect(&target.owner_url, 2).await?;
    let tenants = |t: &[&str]| Some(t.iter().map(|t| (*t).to_owned()).collect());
    let scopes = |s: &str| vec![s.to_owned()];
    let (_, small_key) = outboxd::auth::issue_key(
        &owner,
        "bench-small-producer",
        tenants(&[SMALL_TENANT]),
        scopes("produce"),
        Vec::new(),
    )
    .await?;
    let (_, both_key) = outboxd::auth::issue_key(
        &owner,
        "bench-both-worker",
        tenants(&[TENANT, SMALL_TENANT]),
        scopes("consume"),
        Vec::new(),
    )
    .await?;
    owner.close().await;
    if sizes.analyze {
        analyze(&target.owner_url).await?;
    }

    let scenario = format!(
        "tenant {SMALL_TENANT} at {SMALL_RATE}/s, {} workers × batch {} serving both, \
         while they burn down {backlog} of tenant {TENANT}",
        sizes.workers, sizes.claim_batch
    );
    eprintln!("outboxd-bench: outboxd {scenario}");
    let section = Section::start(meter, &target, &[]).await?;
    let shape = Shape {
        workers: sizes.workers,
        concurrency: sizes.claim_batch as usize,
        claim_batch: sizes.claim_batch as usize,
        wait: Duration::from_millis(200),
        replay_claims: false,
    };
    let workers = Workers::start(section.endpoint(), &both_key, THROUGHPUT_KIND, &shape)?;
    let mut producer = connect_client(section.endpoint(), &small_key).await?;
    let offered = (f64::from(SMALL_RATE) * sizes.rate_seconds).round() as u64;
    let period = Duration::from_secs_f64(1.0 / f64::from(SMALL_RATE));
    let start = Instant::now();
    let mut sent = Vec::with_capacity(offered as usize);
    for k in 0..offered {
        tokio::time::sleep_until((start + period.mul_f64(k as f64)).into()).await;
        let answer = producer
            .enqueue(v1::EnqueueRequest {
                intents: vec![new_intent(k)],
                txn_token: String::new(),
            })
            .await
            .context("the small tenant's Enqueue")?;
        let ok = Instant::now();
        let id = answer
            .into_inner()
            .results
            .first()
            .map(|r| r.id.clone())
            .context("Enqueue answered no result")?;
        sent.push((id, ok));
    }
    let ids: Vec<String> = sent.iter().map(|(id, _)| id.clone()).collect();
    let deadline = Instant::now() + DRAIN_TIMEOUT;
    while workers.claimed_of(&ids) < ids.len() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let seconds = start.elapsed().as_secs_f64();
    let (claimed, _) = workers.stop().await?;
    let cost = section.finish().await?;
    let mut small = Hist::new();
    for (id, ok) in &sent {
        if let Some(at) = claimed.get(id) {
            small.record_signed_ms(signed_ms(*ok, *at));
        }
    }
    let small_claimed = small.len();
    rows.push(Row {
        system: "outboxd".to_owned(),
        key: KEY.to_owned(),
        scenario: format!(
            "{scenario}: the small tenant ({small_claimed} of {} claimed)",
            sent.len()
        ),
        intents: small_claimed,
        seconds: 0.0,
        throughput: false,
        latency: Some(("enqueue OK → claim".to_owned(), small)),
        cost: None,
        outcome: Outcome::Ran,
    });
    rows.push(Row {
        system: "outboxd".to_owned(),
        key: KEY.to_owned(),
        scenario: format!("… meanwhile the backlog of tenant {TENANT}"),
        intents: claimed.len() as u64 - small_claimed,
        seconds,
        throughput: true,
        latency: None,
        cost: Some(cost),
        outcome: Outcome::Ran,
    });
    Ok(())
}

/// Scenario key of the limited burn-down.
const LIMITED_KEY: &str = "burn-down-limited";

/// The burn-down again with a concurrency limit on its kind (one no worker reaches: what a
/// limit costs, not what it holds back); its row says its ratio to the unlimited one.
pub async fn limited_burn_down(
    cluster: &Cluster,
    admin: &mut PgConnection,
    database: &str,
    meter: &Meter,
    sizes: &Sizes,
    rows: &mut Vec<Row>,
) -> anyhow::Result<()> {
    let total = sizes.batched + sizes.single;
    let target = prepare_outbox(cluster, admin, database).await?;
    eprintln!("outboxd-bench: outboxd filling {total} for the limited burn-down");
    fill(&target, total, sizes.batch_clients, Arc::new(new_intent)).await?;
    let limit = 10 * sizes.workers * sizes.claim_batch as usize;
    // As the fleet: every tenant, through the policies (the owner proves none).
    let mut fleet = <PgConnection as sqlx::Connection>::connect(&target.fleet_url).await?;
    sqlx::query(
        "INSERT INTO outbox.queue_policy (tenant_id, kind, max_in_flight, updated_by, reason,
                                          updated_at)
         VALUES ($1, $2, $3, 'outboxd-bench', 'limited burn-down', now())",
    )
    .bind(TENANT)
    .bind(THROUGHPUT_KIND)
    .bind(i32::try_from(limit)?)
    .execute(&mut fleet)
    .await?;
    sqlx::Connection::close(fleet).await?;
    let name = format!(
        "{}, max_in_flight {limit} on its kind",
        burn_down_name(sizes.workers, sizes.claim_batch)
    );
    let mut row = outboxd_burn_down(meter, &target, sizes, total, &[], LIMITED_KEY, name).await?;
    let rate = |r: &Row| (r.seconds > 0.0).then(|| r.intents as f64 / r.seconds);
    let unlimited = rows
        .iter()
        .find(|r| r.system == "outboxd" && r.key == "burn-down")
        .and_then(rate);
    if let Some((limited, unlimited)) = rate(&row).zip(unlimited) {
        row.scenario = format!(
            "{} ({:.2}× the unlimited burn-down)",
            row.scenario,
            limited / unlimited
        );
    }
    rows.push(row);
    Ok(())
}
