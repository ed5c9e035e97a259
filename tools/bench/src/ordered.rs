//! `all`'s ordering-key scenarios (`--only ordered`), each on a database of its own: the
//! burn-down of intents spread over many ordering keys, beside the unordered burn-down of
//! the same run; one hot key, whose intents can only go one at a time; and the fixed rate
//! on other intents, unordered and ordered, before and after a large backlog queues behind
//! a key whose head is dead-lettered (WAITING rows, outside the claimable index, must not
//! slow the Claims of other keys).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use outboxd::proto::v1;
use sqlx::{Connection, PgConnection};

use crate::harness::{Cluster, connect_client};
use crate::meter::Meter;
use crate::report::{Hist, Outcome, Row};
use crate::server::ServerProcess;
use crate::suite::{
    IntentMaker, MAX_BATCH, Section, Sizes, THROUGHPUT_KIND, Target, analyze, burn_down_name,
    drain, enqueue_closed_loop_of, fixed_rate_of, new_intent, outboxd_burn_down, prepare_outbox,
    vacuum,
};
use crate::workers::Shape;

/// The sizes of the ordering scenarios.
pub struct OrderedSizes {
    /// Intents of the ordered burn-down...
    pub intents: u64,
    /// ...spread round-robin over this many keys.
    pub keys: u64,
    /// Intents of the hot key.
    pub hot: u64,
    /// Intents queued behind the blocked key's head.
    pub blocked: u64,
}

/// Offered rate of the blocked-key scenario: the large-history scenario's.
const BLOCKED_RATE: u32 = 1000;

/// Ordering keys of the ordered half of the blocked-key scenario's intents.
const OTHER_KEYS: u64 = 100;

/// The key whose head is dead-lettered.
const BLOCKED_KEY: &str = "blocked";

/// Row key of the ordered burn-down.
const ORDERED_KEY: &str = "burn-down-ordered";

/// What the table's ordering rows are, for its notes.
pub const NOTE: &str = "**ordered**: intents with an ordering key, each scenario on a database of \
    its own. The ordered burn-down is the burn-down (same workers, batch and ANALYZE) of \
    intents enqueued in batches of 1000 with keys round-robin, so that each key's intents \
    are leased one at a time in commit order; its ratio is to the unordered burn-down of \
    the same run. The hot key's intents are all of one key: its rate is the key's \
    sequential rate, its latency the time from one intent's Claim answered to the next's. \
    The blocked key is one intent of a key claimed and failed for good (dead-lettered, so \
    its key waits for an operator); the fixed rate runs before and after the backlog of \
    WAITING intents is queued behind it, sends every second intent with one of 100 other \
    keys, and reports their enqueue OK → claim apart from the unordered ones'.";

/// Whether the cluster records commit times, which ordered intents need.
pub async fn commit_times(admin: &mut PgConnection) -> anyhow::Result<bool> {
    let on: String = sqlx::query_scalar("SHOW track_commit_timestamp")
        .fetch_one(admin)
        .await?;
    Ok(on == "on")
}

/// The line of the run's header that gives the ordering scenarios' sizes.
pub fn describe(sizes: &Sizes) -> String {
    let o = &sizes.ordered;
    format!(
        "ordering keys: burn-down of {} intents over {} keys (workers and batch as above); hot \
         key {} intents; blocked key {} intents behind a dead-lettered head, {BLOCKED_RATE}/s \
         offered for {} s with every second intent ordered (over {OTHER_KEYS} other keys)",
        o.intents, o.keys, o.hot, o.blocked, sizes.rate_seconds
    )
}

fn ordered_intent(n: u64, key: String) -> v1::NewIntent {
    v1::NewIntent {
        ordering_key: key,
        ..new_intent(n)
    }
}

/// Why a scenario did not run on a cluster without commit times, as its row.
fn without_commit_times(key: &str, scenario: &str) -> Row {
    Row::not_run(
        "outboxd",
        key,
        scenario,
        "the cluster's track_commit_timestamp is off (ordering keys need it)",
    )
}

/// Enqueues `total` intents of `make` in batches of [`MAX_BATCH`] through a server of its
/// own (not measured).
pub(crate) async fn fill(
    target: &Target,
    total: u64,
    clients: usize,
    make: Arc<IntentMaker>,
) -> anyhow::Result<()> {
    let server = ServerProcess::spawn(&target.service_url, &target.fleet_url, &[]).await?;
    let filled = enqueue_closed_loop_of(
        &server.endpoint,
        &target.producer_key,
        total,
        MAX_BATCH as u64,
        clients,
        make,
    )
    .await;
    server.stop().await?;
    filled.map(drop)
}

/// Intents of `target` in `state`.
async fn count(target: &Target, state: &str) -> anyhow::Result<i64> {
    let mut owner = PgConnection::connect(&target.owner_url).await?;
    let n = sqlx::query_scalar("SELECT count(*) FROM outbox.all_intents WHERE state::text = $1")
        .bind(state)
        .fetch_one(&mut owner)
        .await?;
    owner.close().await?;
    Ok(n)
}

/// The ordered burn-down: `sizes.ordered.intents` over `keys` keys, drained by the
/// unordered burn-down's workers; its row says its ratio to that one's rate when it ran.
pub async fn burn_down(
    cluster: &Cluster,
    admin: &mut PgConnection,
    database: &str,
    meter: &Meter,
    sizes: &Sizes,
    commit_times: bool,
    rows: &mut Vec<Row>,
) -> anyhow::Result<()> {
    let (total, keys) = (sizes.ordered.intents, sizes.ordered.keys);
    let name = format!(
        "{}, ordered: {total} intents over {keys} keys",
        burn_down_name(sizes.workers, sizes.claim_batch)
    );
    if !commit_times {
        rows.push(without_commit_times(ORDERED_KEY, &name));
        return Ok(());
    }
    let target = prepare_outbox(cluster, admin, database).await?;
    eprintln!("outboxd-bench: outboxd filling {total} ordered intents over {keys} keys");
    let make = move |n: u64| ordered_intent(n, format!("key-{}", n % keys));
    fill(&target, total, sizes.batch_clients, Arc::new(make)).await?;
    let mut row = outboxd_burn_down(meter, &target, sizes, total, &[], ORDERED_KEY, name).await?;
    let left = total as i64 - count(&target, "delivered").await?;
    ensure!(
        left == 0,
        "the ordered burn-down left {left} intents undelivered"
    );
    let rate = |r: &Row| (r.seconds > 0.0).then(|| r.intents as f64 / r.seconds);
    let unordered = rows
        .iter()
        .find(|r| r.system == "outboxd" && r.key == "burn-down")
        .and_then(rate);
    if let Some((ordered, unordered)) = rate(&row).zip(unordered) {
        row.scenario = format!(
            "{} ({:.2}× the unordered burn-down)",
            row.scenario,
            ordered / unordered
        );
    }
    rows.push(row);
    Ok(())
}

/// The hot key: `sizes.ordered.hot` intents of one key, drained by the burn-down's workers.
/// The rate is the key's sequential rate (one intent leased at a time); the latency, from
/// one intent's Claim answered to the next's.
pub async fn hot_key(
    cluster: &Cluster,
    admin: &mut PgConnection,
    database: &str,
    meter: &Meter,
    sizes: &Sizes,
    commit_times: bool,
    rows: &mut Vec<Row>,
) -> anyhow::Result<()> {
    let total = sizes.ordered.hot;
    let name = format!(
        "one hot key: {total} intents, one at a time, {} workers",
        sizes.workers
    );
    if !commit_times {
        rows.push(without_commit_times("hot-key", &name));
        return Ok(());
    }
    let target = prepare_outbox(cluster, admin, database).await?;
    eprintln!("outboxd-bench: outboxd filling {total} intents of one key");
    // One client: the key's lock makes its Enqueues take turns anyway.
    let make = |n: u64| ordered_intent(n, "hot".to_owned());
    fill(&target, total, 1, Arc::new(make)).await?;
    if sizes.analyze {
        analyze(&target.owner_url).await?;
    }
    eprintln!("outboxd-bench: outboxd {name}");
    // The burn-down's workers: every Claim but one finds nothing and long-polls, and the
    // Ack of the key's head hands the next one to whichever is waiting.
    let shape = Shape {
        workers: sizes.workers,
        concurrency: sizes.claim_batch as usize,
        claim_batch: sizes.claim_batch as usize,
        wait: Duration::from_secs(1),
        replay_claims: true,
    };
    let section = Section::start(meter, &target, &[]).await?;
    let t0 = Instant::now();
    let drained = drain(section.endpoint(), &target.worker_key, total, &shape).await;
    let seconds = t0.elapsed().as_secs_f64();
    let cost = section.finish().await?;
    let (acked, claimed, _) = drained?;
    ensure!(
        acked == total,
        "the hot key acked {acked} of {total} intents"
    );
    let mut at = claimed.into_values().collect::<Vec<_>>();
    at.sort();
    let mut hist = Hist::new();
    for pair in at.windows(2) {
        hist.record(pair[1] - pair[0]);
    }
    rows.push(Row {
        system: "outboxd".to_owned(),
        key: "hot-key".to_owned(),
        scenario: name,
        intents: acked,
        seconds,
        throughput: true,
        latency: Some(("claim → next claim".to_owned(), hist)),
        cost: Some(cost),
        outcome: Outcome::Ran,
    });
    Ok(())
}

/// The blocked key: a key's head dead-lettered, the fixed rate of mixed intents, then
/// `sizes.ordered.blocked` intents queued behind the head and the fixed rate again.
pub async fn blocked_key(
    cluster: &Cluster,
    admin: &mut PgConnection,
    database: &str,
    meter: &Meter,
    sizes: &Sizes,
    commit_times: bool,
    rows: &mut Vec<Row>,
) -> anyhow::Result<()> {
    let blocked = sizes.ordered.blocked;
    if !commit_times {
        let name = format!("enqueue → claim at {BLOCKED_RATE}/s, {blocked} behind a blocked key");
        rows.push(without_commit_times("blocked-key", &name));
        return Ok(());
    }
    let target = prepare_outbox(cluster, admin, database).await?;
    let server = ServerProcess::spawn(&target.service_url, &target.fleet_url, &[]).await?;
    let dead = dead_letter_head(&server.endpoint, &target).await;
    server.stop().await?;
    dead?;
    vacuum(&target.owner_url).await?;
    rows.extend(mixed_rate(meter, &target, sizes, ", key blocked, no backlog").await?);

    eprintln!("outboxd-bench: outboxd queueing {blocked} intents behind the blocked key");
    let make = |n: u64| ordered_intent(n + 1, BLOCKED_KEY.to_owned());
    fill(&target, blocked, sizes.batch_clients, Arc::new(make)).await?;
    let waiting = count(&target, "waiting").await?;
    ensure!(
        waiting == blocked as i64,
        "{waiting} intents WAITING behind the blocked key, not {blocked}"
    );
    // As autovacuum would leave a table that grew this way (the first run had it too).
    vacuum(&target.owner_url).await?;
    let context = format!(", {blocked} WAITING behind the blocked key");
    rows.extend(mixed_rate(meter, &target, sizes, &context).await?);
    Ok(())
}

/// Enqueues the blocked key's head (max_attempts 1), claims it and fails it for good: it
/// is DEAD_LETTERED, and its key holds every later intent until an operator decides.
async fn dead_letter_head(endpoint: &str, target: &Target) -> anyhow::Result<()> {
    let mut producer = connect_client(endpoint, &target.producer_key).await?;
    let mut worker = connect_client(endpoint, &target.worker_key).await?;
    let head = v1::NewIntent {
        max_attempts: 1,
        ..ordered_intent(0, BLOCKED_KEY.to_owned())
    };
    let enqueued = producer
        .enqueue(v1::EnqueueRequest {
            intents: vec![head],
            txn_token: String::new(),
        })
        .await
        .context("Enqueue of the blocked key's head")?
        .into_inner()
        .results;
    let id = enqueued
        .first()
        .context("Enqueue answered no result")?
        .id
        .clone();
    let leases = worker
        .claim(v1::ClaimRequest {
            worker_id: "bench-blocker".to_owned(),
            kinds: vec![THROUGHPUT_KIND.to_owned()],
            max_intents: 1,
            wait: Some(prost_types::Duration {
                seconds: 5,
                nanos: 0,
            }),
            ..Default::default()
        })
        .await
        .context("Claim of the blocked key's head")?
        .into_inner()
        .leases;
    let lease = leases
        .first()
        .context("the blocked key's head was not claimable")?;
    let leased = lease.intent.as_ref().map(|i| i.id.as_str());
    ensure!(
        leased == Some(id.as_str()),
        "claimed {leased:?}, not the head {id}"
    );
    let failed = worker
        .fail(v1::FailRequest {
            failures: vec![v1::Failure {
                lease: Some(v1::LeaseRef {
                    intent_id: id.clone(),
                    lease_id: lease.lease_id.clone(),
                }),
                error: "outboxd-bench: the blocked key's head".to_owned(),
                outcome: v1::FailOutcome::Permanent.into(),
                retry_after: None,
            }],
        })
        .await
        .context("Fail of the blocked key's head")?
        .into_inner()
        .results;
    let dead = failed
        .first()
        .is_some_and(|r| r.error.is_none() && r.state() == v1::IntentState::DeadLettered);
    ensure!(dead, "the head was not dead-lettered: {failed:?}");
    Ok(())
}

/// Every second intent unordered, the others over [`OTHER_KEYS`] keys in turn.
fn mixed_intent(k: u64) -> v1::NewIntent {
    if k.is_multiple_of(2) {
        new_intent(k)
    } else {
        ordered_intent(k, format!("other-{}", (k / 2) % OTHER_KEYS))
    }
}

/// The fixed rate of mixed intents on a fresh server: its row (all the intents, with the
/// verdict and the cost), then the unordered and the ordered ones' latencies apart.
async fn mixed_rate(
    meter: &Meter,
    target: &Target,
    sizes: &Sizes,
    context: &str,
) -> anyhow::Result<Vec<Row>> {
    let context = format!(", half ordered{context}");
    eprintln!("outboxd-bench: outboxd enqueue → claim at {BLOCKED_RATE}/s{context}");
    let section = Section::start(meter, target, &[]).await?;
    let run = fixed_rate_of(
        section.endpoint(),
        target,
        BLOCKED_RATE,
        sizes.rate_seconds,
        sizes.rate_workers(),
        &mixed_intent,
    )
    .await;
    let cost = section.finish().await?;
    let (run, [unordered, ordered]) = run?;
    let (mut row, _) = run.row("outboxd", BLOCKED_RATE, sizes.rate_seconds, &context, cost);
    row.key = "blocked-key".to_owned();
    let mut out = vec![row];
    for (half, hist) in [("unordered", unordered), ("ordered", ordered)] {
        out.push(Row {
            system: "outboxd".to_owned(),
            key: "blocked-key".to_owned(),
            scenario: format!("… of which the {half} intents"),
            intents: hist.len(),
            seconds: 0.0,
            throughput: false,
            latency: Some(("enqueue OK → claim".to_owned(), hist)),
            cost: None,
            outcome: Outcome::Ran,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::suite::{AllArgs, SectionName};

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        all: AllArgs,
    }

    #[test]
    fn only_ordered_selects_the_three_ordering_scenarios_and_nothing_else() {
        let ordered = Cli::parse_from(["all", "--only", "ordered"]).all;
        for s in [
            SectionName::OrderedBurnDown,
            SectionName::HotKey,
            SectionName::BlockedKey,
        ] {
            assert!(ordered.runs(s), "{s:?}");
        }
        assert!(!ordered.runs(SectionName::Throughput));
        let hot = Cli::parse_from(["all", "--only", "hot-key"]).all;
        assert!(hot.runs(SectionName::HotKey));
        assert!(!hot.runs(SectionName::BlockedKey));
        assert!(Cli::parse_from(["all"]).all.runs(SectionName::BlockedKey));
    }

    #[test]
    fn every_second_intent_of_the_mixed_rate_is_ordered_over_the_other_keys() {
        assert!(mixed_intent(0).ordering_key.is_empty());
        assert_eq!(mixed_intent(1).ordering_key, "other-0");
        assert_eq!(mixed_intent(3).ordering_key, "other-1");
        assert_eq!(mixed_intent(2 * OTHER_KEYS + 1).ordering_key, "other-0");
        assert_eq!(mixed_intent(7).kind, THROUGHPUT_KIND);
    }
}
