//! `outboxd-faults repro <scenario>`: deterministic reproductions of the bugs the fault
//! suite found, kept as regression checks (each exits 0 once outboxd handles it).
//!
//! `xid-reuse`: PostgreSQL does not WAL-log the assignment of a transaction id. A transaction that took
//! its token (`outbox.txn_token()` assigns the xid) and whose WAL was not flushed when the
//! server crashed leaves no trace: after crash recovery the same xid is handed to the next
//! transaction that needs one. An Enqueue carrying the dead transaction's token, retried
//! after the restart as any client retries a call that failed during an outage, then finds
//! that xid "in progress" (the stranger's), stores the intents STAGED under it, and they
//! follow the stranger: its COMMIT makes them claimable, though the producer's transaction
//! aborted. That breaks "an intent whose producer transaction aborted is never claimable".
//!
//! `replay-race`: a client retries an Ack (or MarkSubmitted) whose first attempt is still
//! running on the server, e.g. blocked on a row lock or on a frozen replica, as any client
//! with a deadline does. The retry's UPDATE waits for the first attempt, re-checks the row
//! it committed and does not apply; but the per-item report reads the intent under the
//! statement's original snapshot (still LEASED with this lease), so the retry answers
//! LEASE_LOST instead of the documented replay OK (README, "Lost responses"). A worker
//! told LEASE_LOST after MarkSubmitted skips its side effect, and the intent, SUBMITTED by
//! its own lease, later needs an operator.

use std::time::Duration;

use outboxd::proto::v1;
use sqlx::{Connection, PgConnection};

use crate::cluster::Cluster;
use crate::processes::{Launch, Supervised};
use crate::rpc::{CALL_TIMEOUT, Rpc, request};
use crate::run::{free_port, replica_env, wait_serving};

/// Command line of `outboxd-faults repro`.
#[derive(Debug, clap::Args)]
pub struct ReproArgs {
    /// Which bug to reproduce.
    #[arg(value_enum)]
    pub scenario: Scenario,
    /// The outboxd binary [default: `outboxd` next to this one].
    #[arg(long)]
    pub outboxd: Option<std::path::PathBuf>,
}

/// The reproducible bugs.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum Scenario {
    /// An Enqueue retried after a PostgreSQL crash joins a stranger's reused xid.
    XidReuse,
    /// A retried Ack/MarkSubmitted racing its first attempt answers LEASE_LOST.
    ReplayRace,
}

/// Runs the scenario; Ok(true) when outboxd kept the guarantee.
pub async fn run(args: ReproArgs) -> anyhow::Result<bool> {
    let dir = std::env::temp_dir().join(format!("outboxd-repro-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let outboxd = match args.outboxd {
        Some(path) => path,
        None => std::env::current_exe()?.with_file_name("outboxd"),
    };
    let cluster = Cluster::start(&dir.join("pgdata")).await?;
    let port = free_port()?;
    let env = replica_env(&cluster, port);
    let log = dir.join("outboxd.log");
    let server = Supervised::new(
        "r1",
        Box::new(move |_| Launch {
            program: outboxd.clone(),
            args: vec!["serve".into()],
            env: env.clone(),
            log: log.clone(),
        }),
    );
    server.start().await?;
    wait_serving(port, Duration::from_secs(30)).await?;
    let endpoint = vec![format!("127.0.0.1:{port}")];
    let mut producer_rpc = Rpc::new(&endpoint, &cluster.keys.producer, 1)?;
    let mut worker_rpc = Rpc::new(&endpoint, &cluster.keys.worker, 2)?;
    let outcome = match args.scenario {
        Scenario::XidReuse => xid_reuse(&cluster, &mut producer_rpc, &mut worker_rpc).await,
        Scenario::ReplayRace => replay_race(&cluster, &mut producer_rpc, &endpoint).await,
    };
    server.terminate(Duration::from_secs(5)).await;
    cluster.stop().await?;
    let _ = std::fs::remove_dir_all(&dir);
    outcome
}

async fn xid_reuse(
    cluster: &Cluster,
    producer: &mut Rpc,
    worker: &mut Rpc,
) -> anyhow::Result<bool> {
    // 1. The producer opens its transaction and takes its token; the crash comes before
    //    its Enqueue gets through (the call is retried after the restart).
    let mut a = PgConnection::connect(&cluster.owner_url).await?;
    sqlx::raw_sql("BEGIN").execute(&mut a).await?;
    // Taken without the WAL record `outbox.txn_token()` writes (migration
    // `…02_baseline_functions` says why it does): with it, its xid usually reaches the disk
    // before the crash, and there would be no reuse to reproduce. A producer on the older plain SQL
    // still takes such tokens.
    let token: String = sqlx::query_scalar(
        "SELECT 'v2.' || system_identifier || '.' || outbox.server_incarnation() || '.' \
         || pg_current_xact_id() FROM pg_control_system()",
    )
    .fetch_one(&mut a)
    .await?;
    let xid: i64 = token.rsplit('.').next().unwrap_or_default().parse()?;
    println!("1. producer transaction A took token {token} (xid {xid}), then PostgreSQL crashed");
    cluster.crash().await?;
    cluster.restart().await?;
    drop(a);

    // 2. Other sessions of the application run transactions after the restart: the
    //    counter hands out xids again from below A's.
    let mut other = PgConnection::connect(&cluster.owner_url).await?;
    // The next xid to be assigned, without taking it.
    let next: i64 =
        sqlx::query_scalar("SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint")
            .fetch_one(&mut other)
            .await?;
    anyhow::ensure!(
        next <= xid,
        "xid {xid} was not reused this time (next xid {next}); run again"
    );
    for _ in next..xid {
        sqlx::query("SELECT pg_current_xact_id()")
            .execute(&mut other)
            .await?;
    }
    sqlx::raw_sql("BEGIN").execute(&mut other).await?;
    let stranger: i64 = sqlx::query_scalar("SELECT pg_current_xact_id()::text::bigint")
        .fetch_one(&mut other)
        .await?;
    anyhow::ensure!(
        stranger == xid,
        "could not line up the xid ({stranger} != {xid}); run again"
    );
    println!("2. after recovery, an unrelated transaction S was given the same xid {stranger}");

    // 3. The producer's retried Enqueue with A's token. A died in the crash, so the right
    //    answer is ABORTED (or at least a refusal); anything stored must end DISCARDED.
    let message = v1::EnqueueRequest {
        txn_token: token.clone(),
        intents: vec![v1::NewIntent {
            kind: crate::IDEMPOTENT_KIND.into(),
            payload: b"{\"order\":\"of the dead transaction A\"}".to_vec(),
            idempotency_key: "repro/a".into(),
            ..Default::default()
        }],
    };
    let enqueued = producer
        .call(Duration::from_secs(10), |mut client| {
            let request = request(message.clone(), CALL_TIMEOUT);
            async move { client.enqueue(request).await }
        })
        .await;
    let id = match enqueued {
        Err(e) => {
            println!(
                "3. Enqueue with A's token refused: {}  (correct)",
                e.describe()
            );
            sqlx::raw_sql("COMMIT").execute(&mut other).await?;
            return Ok(true);
        }
        Ok(called) => {
            let result = called.value.results.first().cloned().unwrap_or_default();
            println!(
                "3. Enqueue with A's token answered OK: intent {} {:?}  <- A is dead",
                result.id,
                result.state()
            );
            result.id
        }
    };

    // 4. The stranger commits; a worker claims.
    sqlx::raw_sql("COMMIT").execute(&mut other).await?;
    println!("4. S committed");
    let claim = v1::ClaimRequest {
        worker_id: "repro-worker".into(),
        max_intents: 10,
        wait: Some(prost_types::Duration {
            seconds: 3,
            nanos: 0,
        }),
        request_id: "repro-claim".into(),
        ..Default::default()
    };
    let claimed = worker
        .call(Duration::from_secs(10), |mut client| {
            let request = request(claim.clone(), CALL_TIMEOUT + Duration::from_secs(3));
            async move { client.claim(request).await }
        })
        .await
        .map_err(|e| anyhow::anyhow!(e.describe()))?;
    let taken = claimed
        .value
        .leases
        .iter()
        .any(|l| l.intent.as_ref().is_some_and(|i| i.id == id));
    let state: String =
        sqlx::query_scalar("SELECT state::text FROM outbox.all_intents WHERE id = $1::uuid")
            .bind(&id)
            .fetch_one(&cluster.admin)
            .await?;
    if taken {
        println!(
            "5. BUG: a worker claimed intent {id} of the aborted transaction A (now {state}); \
             it followed S, the transaction that reused A's xid"
        );
        Ok(false)
    } else {
        println!("5. intent {id} is {state} and was not claimed (correct)");
        Ok(state == "discarded")
    }
}

async fn replay_race(
    cluster: &Cluster,
    producer: &mut Rpc,
    endpoint: &[String],
) -> anyhow::Result<bool> {
    let mut correct = true;
    for call in ["Ack", "MarkSubmitted"] {
        correct &= replay_race_once(cluster, producer, endpoint, call).await?;
    }
    Ok(correct)
}

/// One intent, one lease, two concurrent identical `call`s with that lease, the first
/// ahead of the second in the row's lock queue.
async fn replay_race_once(
    cluster: &Cluster,
    producer: &mut Rpc,
    endpoint: &[String],
    call: &'static str,
) -> anyhow::Result<bool> {
    let message = v1::EnqueueRequest {
        txn_token: String::new(),
        intents: vec![v1::NewIntent {
            kind: crate::PAYMENT_KIND.into(),
            payload: b"{}".to_vec(),
            ..Default::default()
        }],
    };
    let enqueued = producer
        .call(Duration::from_secs(10), |mut client| {
            let request = request(message.clone(), CALL_TIMEOUT);
            async move { client.enqueue(request).await }
        })
        .await
        .map_err(|e| anyhow::anyhow!(e.describe()))?;
    let id = enqueued.value.results[0].id.clone();
    let mut worker = Rpc::new(endpoint, &cluster.keys.worker, 3)?;
    let claim = v1::ClaimRequest {
        worker_id: format!("repro-{call}"),
        max_intents: 1,
        ..Default::default()
    };
    let claimed = worker
        .call(Duration::from_secs(10), |mut client| {
            let request = request(claim.clone(), CALL_TIMEOUT);
            async move { client.claim(request).await }
        })
        .await
        .map_err(|e| anyhow::anyhow!(e.describe()))?;
    let lease = claimed
        .value
        .leases
        .first()
        .ok_or_else(|| anyhow::anyhow!("nothing claimed"))?;
    let lease = v1::LeaseRef {
        intent_id: id.clone(),
        lease_id: lease.lease_id.clone(),
    };
    println!("{call}: intent {id} leased; a long transaction locks its row");
    // Something else holds the row for a moment (a long transaction, a frozen replica that
    // applied the first attempt but has not committed yet).
    let mut holder = PgConnection::connect(&cluster.owner_url).await?;
    sqlx::raw_sql("BEGIN").execute(&mut holder).await?;
    sqlx::query("SELECT 1 FROM outbox.intent WHERE id = $1::uuid FOR UPDATE")
        .bind(&id)
        .execute(&mut holder)
        .await?;
    let send = |lease: v1::LeaseRef| {
        let mut rpc = Rpc::new(endpoint, &cluster.keys.worker, 4).expect("endpoints");
        tokio::spawn(async move {
            let outcome = rpc
                .call(Duration::from_secs(10), |mut client| {
                    let lease = lease.clone();
                    async move {
                        let results = match call {
                            "Ack" => {
                                let message = v1::AckRequest {
                                    leases: vec![lease],
                                };
                                client
                                    .ack(request(message, CALL_TIMEOUT))
                                    .await?
                                    .into_inner()
                                    .results
                            }
                            _ => {
                                let message = v1::MarkSubmittedRequest {
                                    leases: vec![lease],
                                };
                                client
                                    .mark_submitted(request(message, CALL_TIMEOUT))
                                    .await?
                                    .into_inner()
                                    .results
                            }
                        };
                        Ok(tonic::Response::new(results))
                    }
                })
                .await;
            match outcome {
                Ok(called) => match called.value.first().and_then(|r| r.error.as_ref()) {
                    None => "OK".to_owned(),
                    Some(e) => format!("refused {}", e.reason),
                },
                Err(e) => e.describe(),
            }
        })
    };
    let first = send(lease.clone());
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The client's retry (its deadline passed): the same call with the same lease.
    let retry = send(lease.clone());
    tokio::time::sleep(Duration::from_millis(300)).await;
    sqlx::raw_sql("ROLLBACK").execute(&mut holder).await?;
    let (first, retry) = (first.await?, retry.await?);
    let state: String = sqlx::query_scalar(
        "SELECT state::text || ' with lease ' || \
                CASE WHEN lease_id = $2::uuid THEN 'of this worker' ELSE 'of someone else' END \
         FROM outbox.all_intents WHERE id = $1::uuid",
    )
    .bind(&id)
    .bind(&lease.lease_id)
    .fetch_one(&cluster.admin)
    .await?;
    println!("{call}: first attempt {first}; retry with the same lease {retry}; intent is {state}");
    let correct = retry == "OK";
    if !correct {
        println!(
            "{call}: BUG: the retry of an applied {call} must answer OK (README, \"Lost responses\")"
        );
    }
    Ok(correct)
}
