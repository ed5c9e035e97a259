//! A producer process: two-phase transactions on the outbox's own database that commit or
//! roll back at random, and direct enqueues, journaled: all with idempotency keys but half
//! the direct ones (which an enqueue may hand to a waiting Claim, and whose retry after a
//! lost answer enqueues them again, as an unkeyed producer's does). Each
//! two-phase transaction also writes the producer's own rows (`faults.producer_order` and
//! `faults.order_intent`), so after the run those tables say which transactions committed
//! whatever the producer managed to log before it was killed.
//!
//! Of the kinds, payments (30 %) and e-mails (55 %) have queue limits, notices (15 %) none.
//! Half the intents but notices carry an ordering key drawn from a small set shared by every producer
//! of the run (`--ordering-keys`), so that each key has several intents in flight and the
//! two-phase producers' commits interleave on the same keys; now and then two intents of
//! one Enqueue share a key (request order). The checker holds the deliveries of each key
//! to the order their transactions committed (`checker::ordering`).

use std::path::PathBuf;
use std::time::Duration;

use outboxd::proto::v1;
use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection};
use uuid::Uuid;

use crate::journal::{Event, Journal, now_us};
use crate::rng::Rng;
use crate::rpc::{CALL_TIMEOUT, Called, Rpc, request};
use crate::{API_KEY_ENV, IDEMPOTENT_KIND, NOTICE_KIND, PAYMENT_KIND};

/// Retry budget of an Enqueue inside an open transaction: long enough to ride out a killed
/// replica, short enough not to hold the transaction for ever.
const TXN_ENQUEUE_BUDGET: Duration = Duration::from_secs(8);

/// Retry budget of a direct Enqueue.
const DIRECT_ENQUEUE_BUDGET: Duration = Duration::from_secs(15);

/// `application_name` of producer sessions (the backend-termination fault looks for it).
pub const APPLICATION_NAME: &str = "outboxd-faults-producer";

/// Attempts allowed per intent before it is dead-lettered.
const MAX_ATTEMPTS: i32 = 8;

/// Command line of `outboxd-faults producer` (started by `run`, not by hand).
#[derive(Debug, clap::Args)]
pub struct ProducerArgs {
    /// Producer name; prefixes its idempotency keys and names its journal.
    #[arg(long)]
    pub name: String,
    /// outboxd endpoints (`host:port`), comma separated.
    #[arg(long, value_delimiter = ',', required = true)]
    pub endpoints: Vec<String>,
    /// Journal file to append to.
    #[arg(long)]
    pub journal: PathBuf,
    /// Seed of this producer's choices.
    #[arg(long)]
    pub seed: u64,
    /// The outbox database, as a role that may write the `faults` tables.
    #[arg(long)]
    pub database_url: String,
    /// Pause between transactions, in milliseconds (the load knob).
    #[arg(long, default_value_t = 60)]
    pub pause_ms: u64,
    /// Ordering keys shared by the run's producers; half the intents take one (0: none).
    #[arg(long, default_value_t = 32)]
    pub ordering_keys: u64,
}

/// Share of intents that carry an ordering key.
const ORDERED_SHARE: f64 = 0.5;

/// Chance that an ordered intent takes the key of the ordered intent before it in the same
/// Enqueue: two intents of one key in one request, delivered in request order.
const SAME_KEY_AGAIN: f64 = 0.3;

/// The ordering key number `n` of the run (the same names in every producer).
pub fn ordering_key(n: u64) -> String {
    format!("key-{n:02}")
}

struct Producer {
    name: String,
    rpc: Rpc,
    rng: Rng,
    journal: Journal,
    options: PgConnectOptions,
    connection: Option<PgConnection>,
    seq: u64,
    ordering_keys: u64,
}

/// Runs until SIGTERM, then finishes the transaction in hand and exits.
pub async fn run(args: ProducerArgs) -> anyhow::Result<()> {
    let key = std::env::var(API_KEY_ENV)?;
    let stop = crate::stop_on_sigterm()?;
    let options: PgConnectOptions = args.database_url.parse()?;
    let mut producer = Producer {
        rpc: Rpc::new(&args.endpoints, &key, args.seed)?,
        rng: Rng::new(args.seed.rotate_left(23)),
        journal: Journal::create(&args.journal)?,
        options: options.application_name(APPLICATION_NAME),
        connection: None,
        seq: 0,
        ordering_keys: args.ordering_keys,
        name: args.name,
    };
    while !stop.is_cancelled() {
        if producer.rng.chance(0.7) {
            producer.two_phase().await;
        } else {
            producer.direct().await;
        }
        let pause = producer
            .rng
            .millis(args.pause_ms / 2, args.pause_ms * 3 / 2);
        tokio::time::sleep(pause).await;
    }
    Ok(())
}

impl Producer {
    fn intents(&mut self, prefix: &str, count: u64) -> Vec<v1::NewIntent> {
        let mut previous_key: Option<String> = None;
        (0..count)
            .map(|i| {
                let kind = match self.rng.below(100) {
                    0..30 => PAYMENT_KIND,
                    30..45 => NOTICE_KIND,
                    _ => IDEMPOTENT_KIND,
                };
                let ordering_key = match &previous_key {
                    _ if kind == NOTICE_KIND
                        || self.ordering_keys == 0
                        || !self.rng.chance(ORDERED_SHARE) =>
                    {
                        String::new()
                    }
                    Some(key) if self.rng.chance(SAME_KEY_AGAIN) => key.clone(),
                    _ => ordering_key(self.rng.below(self.ordering_keys)),
                };
                if !ordering_key.is_empty() {
                    previous_key = Some(ordering_key.clone());
                }
                let payload = serde_json::json!({"producer": self.name, "seq": self.seq, "i": i});
                v1::NewIntent {
                    kind: kind.to_owned(),
                    payload: payload.to_string().into_bytes(),
                    content_type: "application/json".to_owned(),
                    idempotency_key: format!("{}/{prefix}{}/{i}", self.name, self.seq),
                    max_attempts: MAX_ATTEMPTS,
                    ordering_key,
                    ..Default::default()
                }
            })
            .collect()
    }

    /// The producer's session, reconnecting after a crash or a terminated backend.
    async fn session(&mut self) -> Option<PgConnection> {
        if let Some(connection) = self.connection.take() {
            return Some(connection);
        }
        match PgConnection::connect_with(&self.options).await {
            Ok(connection) => Some(connection),
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(200)).await;
                None
            }
        }
    }

    /// One two-phase transaction: order row, token, Enqueue, link rows, then COMMIT (80 %)
    /// or ROLLBACK. A connection that failed is dropped, not reused.
    async fn two_phase(&mut self) {
        let Some(mut connection) = self.session().await else {
            return;
        };
        self.seq += 1;
        let count = 1 + self.rng.below(3);
        let intents = self.intents("t", count);
        if self.transaction(&mut connection, intents).await {
            self.connection = Some(connection);
        }
    }

    /// Returns whether the connection is still healthy.
    async fn transaction(
        &mut self,
        connection: &mut PgConnection,
        intents: Vec<v1::NewIntent>,
    ) -> bool {
        let mut order = None;
        let failed = |journal: &Journal, order: Option<i64>, reason: String| {
            journal.log(&Event::RolledBack {
                t: now_us(),
                order,
                reason,
            });
            false
        };
        let mut tx = match connection.begin().await {
            Ok(tx) => tx,
            Err(e) => return failed(&self.journal, order, format!("BEGIN: {e}")),
        };
        let inserted = sqlx::query_scalar(
            "INSERT INTO faults.producer_order (producer, seq) VALUES ($1, $2) RETURNING id",
        )
        .bind(&self.name)
        .bind(self.seq as i64)
        .fetch_one(&mut *tx)
        .await;
        match inserted {
            Ok(id) => order = Some(id),
            Err(e) => return failed(&self.journal, order, format!("INSERT: {e}")),
        }
        let token: String = match sqlx::query_scalar("SELECT outbox.txn_token()")
            .fetch_one(&mut *tx)
            .await
        {
            Ok(token) => token,
            Err(e) => return failed(&self.journal, order, format!("txn_token: {e}")),
        };
        let message = v1::EnqueueRequest {
            intents,
            txn_token: token.clone(),
        };
        let called = self
            .rpc
            .call(TXN_ENQUEUE_BUDGET, |mut client| {
                let request = request(message.clone(), CALL_TIMEOUT);
                async move { client.enqueue(request).await }
            })
            .await;
        let called = match called {
            Ok(called) => called,
            Err(e) => {
                // Rolling back discards whatever a lost-response attempt staged.
                let healthy = tx.rollback().await.is_ok();
                failed(&self.journal, order, format!("Enqueue: {}", e.describe()));
                return healthy;
            }
        };
        let ids: Vec<Uuid> = called
            .value
            .results
            .iter()
            .filter_map(|r| r.id.parse().ok())
            .collect();
        let order_id = order.unwrap_or_default();
        self.journal.log(&Event::Staged {
            t: now_us(),
            order: order_id,
            xid: token.rsplit('.').next().unwrap_or_default().to_owned(),
            intents: ids.clone(),
            tries: called.tries,
            deduplicated: deduplicated(&called.value),
        });
        let linked = sqlx::query(
            "INSERT INTO faults.order_intent (order_id, intent_id) SELECT $1, unnest($2::uuid[])",
        )
        .bind(order_id)
        .bind(&ids)
        .execute(&mut *tx)
        .await;
        if let Err(e) = linked {
            return failed(&self.journal, order, format!("INSERT links: {e}"));
        }
        // The rest of the producer's transaction: a window for kills and terminations.
        tokio::time::sleep(self.rng.millis(10, 80)).await;
        if !self.rng.chance(0.8) {
            let healthy = tx.rollback().await.is_ok();
            failed(&self.journal, order, "chosen".to_owned());
            return healthy;
        }
        self.journal.log(&Event::CommitSent {
            t: now_us(),
            order: order_id,
        });
        match tx.commit().await {
            Ok(()) => {
                self.journal.log(&Event::Committed {
                    t: now_us(),
                    order: order_id,
                });
                true
            }
            Err(e) => {
                self.journal.log(&Event::CommitFailed {
                    t: now_us(),
                    order: order_id,
                    error: e.to_string(),
                });
                false
            }
        }
    }

    /// A direct Enqueue (PENDING at once), retried (with its idempotency keys, if it has
    /// them) until it is acknowledged or the budget runs out.
    async fn direct(&mut self) {
        self.seq += 1;
        let count = 1 + self.rng.below(2);
        let mut intents = self.intents("d", count);
        if self.rng.chance(0.5) {
            for intent in &mut intents {
                intent.idempotency_key.clear();
            }
        }
        let keys = intents
            .iter()
            .map(|i| i.idempotency_key.clone())
            .filter(|k| !k.is_empty())
            .collect();
        let message = v1::EnqueueRequest {
            intents,
            txn_token: String::new(),
        };
        let called = self
            .rpc
            .call(DIRECT_ENQUEUE_BUDGET, |mut client| {
                let request = request(message.clone(), CALL_TIMEOUT);
                async move { client.enqueue(request).await }
            })
            .await;
        match called {
            Ok(called) => self.journal.log(&direct_enqueued(&called)),
            Err(e) => self.journal.log(&Event::DirectUnknown {
                t: now_us(),
                keys,
                error: e.describe(),
            }),
        }
    }
}

/// The journal's record of a direct Enqueue answered OK.
pub fn direct_enqueued(called: &Called<v1::EnqueueResponse>) -> Event {
    Event::DirectEnqueued {
        t: now_us(),
        intents: called
            .value
            .results
            .iter()
            .filter_map(|r| r.id.parse().ok())
            .collect(),
        tries: called.tries,
        deduplicated: deduplicated(&called.value),
    }
}

/// How many results an Enqueue answered as deduplicated.
pub fn deduplicated(response: &v1::EnqueueResponse) -> u32 {
    response.results.iter().filter(|r| r.deduplicated).count() as u32
}
