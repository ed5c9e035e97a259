//! The idle-in-transaction session: one producer transaction held open for the whole run,
//! with an intent staged in it. It pins the xmin horizon (vacuum cannot clean behind it)
//! and keeps a STAGED intent whose transaction is "in progress" in front of the promoter
//! all along. It commits when the drain starts, so its intent must then be delivered. A
//! PostgreSQL crash kills it (its intent must then be discarded) and a new one is opened.
//!
//! It journals with the producers' events, so the checker treats it like any producer.

use std::path::Path;
use std::time::Duration;

use outboxd::proto::v1;
use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::IDEMPOTENT_KIND;
use crate::journal::{Event, Journal, now_us};
use crate::rpc::{CALL_TIMEOUT, Rpc, request};

/// `application_name` of the session.
pub const APPLICATION_NAME: &str = "outboxd-faults-idle";

/// The holder, on a thread of its own; [`IdleTransaction::commit`] ends it.
pub struct IdleTransaction {
    release: CancellationToken,
    thread: std::thread::JoinHandle<u32>,
}

impl IdleTransaction {
    /// Starts holding transactions on `url` (the outbox database), enqueueing through
    /// `endpoints` with `api_key`, journaling to `journal`.
    pub fn spawn(
        url: &str,
        endpoints: Vec<String>,
        api_key: String,
        journal: &Path,
    ) -> anyhow::Result<Self> {
        let options: PgConnectOptions = url.parse()?;
        let options = options.application_name(APPLICATION_NAME);
        let journal = Journal::create(journal)?;
        let release = CancellationToken::new();
        let token = release.clone();
        // Its own single-threaded runtime: the session is one sequential conversation, and
        // nothing of it needs to move between threads.
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let thread = std::thread::Builder::new()
            .name("idle-in-transaction".into())
            .spawn(move || {
                runtime.block_on(async move {
                    match Rpc::new(&endpoints, &api_key, 7) {
                        Ok(rpc) => hold(options, rpc, journal, token).await,
                        Err(_) => 0,
                    }
                })
            })?;
        Ok(Self { release, thread })
    }

    /// Commits the transaction held now; returns how many sessions were opened in all.
    pub async fn commit(self) -> u32 {
        self.release.cancel();
        let thread = self.thread;
        tokio::task::spawn_blocking(move || thread.join().unwrap_or(0))
            .await
            .unwrap_or(0)
    }
}

async fn hold(
    options: PgConnectOptions,
    mut rpc: Rpc,
    journal: Journal,
    release: CancellationToken,
) -> u32 {
    let mut sessions = 0;
    let mut seq = 0i64;
    while !release.is_cancelled() {
        let Ok(mut connection) = PgConnection::connect_with(&options).await else {
            tokio::time::sleep(Duration::from_millis(300)).await;
            continue;
        };
        sessions += 1;
        seq += 1;
        match open(&mut connection, &mut rpc, &journal, seq).await {
            Ok(order) => {
                let done = wait_or_die(&mut connection, &release).await;
                finish(connection, &journal, order, done).await;
            }
            Err(reason) => {
                journal.log(&Event::RolledBack {
                    t: now_us(),
                    order: None,
                    reason,
                });
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        }
    }
    sessions
}

/// BEGIN, order row, token, Enqueue of one intent, link row; the transaction stays open.
async fn open(
    connection: &mut PgConnection,
    rpc: &mut Rpc,
    journal: &Journal,
    seq: i64,
) -> Result<i64, String> {
    let sql = |e: sqlx::Error| e.to_string();
    // REPEATABLE READ: the snapshot, not only the xid, stays pinned all along.
    sqlx::raw_sql("BEGIN ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *connection)
        .await
        .map_err(sql)?;
    let order: i64 = sqlx::query_scalar(
        "INSERT INTO faults.producer_order (producer, seq) VALUES ('idle', $1) RETURNING id",
    )
    .bind(seq)
    .fetch_one(&mut *connection)
    .await
    .map_err(sql)?;
    let token: String = sqlx::query_scalar("SELECT outbox.txn_token()")
        .fetch_one(&mut *connection)
        .await
        .map_err(sql)?;
    let message = v1::EnqueueRequest {
        txn_token: token.clone(),
        intents: vec![v1::NewIntent {
            kind: IDEMPOTENT_KIND.to_owned(),
            payload: format!("{{\"idle\":{seq}}}").into_bytes(),
            content_type: "application/json".to_owned(),
            idempotency_key: format!("idle/t{seq}/0"),
            max_attempts: 8,
            ..Default::default()
        }],
    };
    let called = rpc
        .call(Duration::from_secs(20), |mut client| {
            let request = request(message.clone(), CALL_TIMEOUT);
            async move { client.enqueue(request).await }
        })
        .await
        .map_err(|e| e.describe())?;
    let ids: Vec<Uuid> = called
        .value
        .results
        .iter()
        .filter_map(|r| r.id.parse().ok())
        .collect();
    journal.log(&Event::Staged {
        t: now_us(),
        order,
        xid: token.rsplit('.').next().unwrap_or_default().to_owned(),
        intents: ids.clone(),
        tries: called.tries,
        deduplicated: crate::producer::deduplicated(&called.value),
    });
    sqlx::query(
        "INSERT INTO faults.order_intent (order_id, intent_id) SELECT $1, unnest($2::uuid[])",
    )
    .bind(order)
    .bind(&ids)
    .execute(&mut *connection)
    .await
    .map_err(sql)?;
    Ok(order)
}

/// Waits for the release, checking every second that the session is alive. Returns true
/// when released, false when the session died.
async fn wait_or_die(connection: &mut PgConnection, release: &CancellationToken) -> bool {
    loop {
        tokio::select! {
            _ = release.cancelled() => return true,
            _ = tokio::time::sleep(Duration::from_secs(1)) => {
                if sqlx::query("SELECT 1").execute(&mut *connection).await.is_err() {
                    return false;
                }
            }
        }
    }
}

async fn finish(mut connection: PgConnection, journal: &Journal, order: i64, released: bool) {
    if !released {
        journal.log(&Event::RolledBack {
            t: now_us(),
            order: Some(order),
            reason: "session died (PostgreSQL crash or terminated backend)".into(),
        });
        return;
    }
    journal.log(&Event::CommitSent { t: now_us(), order });
    match sqlx::raw_sql("COMMIT").execute(&mut connection).await {
        Ok(_) => journal.log(&Event::Committed { t: now_us(), order }),
        Err(e) => journal.log(&Event::CommitFailed {
            t: now_us(),
            order,
            error: e.to_string(),
        }),
    }
}
