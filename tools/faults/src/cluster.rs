//! The suite's PostgreSQL: an embedded cluster owned by the suite process (so it outlives
//! outboxd kills and can be crashed on purpose), the `outbox` database with its migrations,
//! service role and API keys, the producers' own tables, and the SQL the orchestrator runs
//! as superuser: backend terminations, the drain probe and the final snapshot.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::Context;
use outboxd::embedded::{EmbeddedConfig, EmbeddedPostgres};
use outboxd::startup;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use uuid::Uuid;

/// Database the outbox lives in.
const DATABASE: &str = "outbox";

/// Role the outboxd replicas connect as (owns nothing; row-level security applies).
const SERVICE_ROLE: &str = "outboxd_service";

/// Role the replicas' fleet pools connect as (a member of outboxd_fleet: every tenant).
const FLEET_ROLE: &str = "outboxd_fleet_service";

/// Tenant of every intent the producers enqueue.
pub const TENANT: &str = "faults";

/// Tenant of the backlog enqueued before the run (`run::backlog`): its intents are older
/// than every intent of [`TENANT`], which must not wait for them (`checker::fairness`). Its
/// name sorts before [`TENANT`]'s, so a claim that served tenants by name would be caught.
pub const BACKLOG_TENANT: &str = "backlog";

/// API keys of the run, one per actor.
#[derive(Debug, Clone)]
pub struct Keys {
    /// `produce` scope.
    pub producer: String,
    /// `consume` scope, both tenants.
    pub worker: String,
    /// `produce` scope, the backlog's tenant.
    pub backlog: String,
    /// `admin` scope (final reconcile).
    pub operator: String,
}

/// The running cluster.
pub struct Cluster {
    postgres: Arc<Mutex<EmbeddedPostgres>>,
    /// Superuser pool on the outbox database (reconnects after crashes).
    pub admin: PgPool,
    /// Superuser URL of the outbox database (producers use it for their own tables).
    pub owner_url: String,
    /// URL the replicas serve through.
    pub service_url: String,
    /// URL the replicas' work across tenants runs through.
    pub fleet_url: String,
    /// The keys.
    pub keys: Keys,
    /// The queue policies set by [`Cluster::limit_queues`].
    limits: Option<QueueLimits>,
}

/// One intent as the database has it at the end.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct IntentRow {
    pub id: Uuid,
    pub tenant_id: String,
    pub kind: String,
    pub state: String,
    pub attempts: i32,
    pub max_attempts: i32,
    /// `pg_xact_status` of its producer transaction (None: direct).
    pub xact: Option<String>,
    pub two_phase: bool,
    /// Its producer transaction's xid (two-phase only).
    pub txn_xid: Option<String>,
    pub lease_id: Option<Uuid>,
    pub last_error: Option<String>,
    /// Its ordering key (None: unordered).
    pub ordering_key: Option<String>,
    /// Its place among the ordered intents of its transaction (`order_seq`).
    pub order_seq: Option<i64>,
    /// When its enqueueing transaction began (`created_at`, µs): its commit came later.
    pub created_us: i64,
    /// `finished_at` in µs: delivered, or an operator's decision (for an ordered
    /// DEAD_LETTERED intent, the DEAD that released its key).
    pub finished_us: Option<i64>,
    /// Commit time of its transaction per PostgreSQL (`pg_xact_commit_timestamp`, µs), for
    /// ordered intents (evidence in reports) and two-phase intents of the unlimited kind
    /// (when they became claimable, for the fairness check).
    pub commit_us: Option<i64>,
}

/// An operator's decision, from `outbox.resolution`.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Resolution {
    pub intent_id: Uuid,
    /// `delivered`, `requeue` or `dead`.
    pub decision: String,
}

/// An ordered intent that holds its key for an operator: DEAD_LETTERED without a decision,
/// or NEEDS_RECONCILE, with intents of its key WAITING behind it.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct BlockedHead {
    pub id: Uuid,
    pub state: String,
    /// How long it has been in that state, in ms.
    pub age_ms: i64,
}

/// The queue policies a run sets before any replica starts (docs/flow-control.md), and
/// checks after the drain from the log the database wrote (`checker::limits`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QueueLimits {
    /// The kind with a concurrency limit.
    pub concurrency_kind: &'static str,
    /// Its `max_in_flight`.
    pub max_in_flight: i64,
    /// The kind with a rate limit.
    pub rate_kind: &'static str,
    /// Its `rate_per_second`.
    pub rate_per_second: f64,
    /// Its `burst`.
    pub burst: i64,
}

/// What every run sets: payments at most 3 in flight (reached: a payment takes ~100 ms
/// and a stopped worker holds its leases to their expiry); e-mails at most 30 leases a
/// second, 10 at once (the producers enqueue ~23 a second, so the limit binds on the
/// backlogs a crash or a stall leaves, and the drain still takes seconds).
pub const QUEUE_LIMITS: QueueLimits = QueueLimits {
    concurrency_kind: crate::PAYMENT_KIND,
    max_in_flight: 3,
    rate_kind: crate::IDEMPOTENT_KIND,
    rate_per_second: 30.0,
    burst: 10,
};

/// One row of `faults.flow_log`: a change of an intent of a limited kind (or of the
/// unlimited kind, for fairness) into or out of LEASED/SUBMITTED, or a lease minted, as the
/// database wrote it in the changing transaction (a rolled-back claim leaves none).
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct FlowChange {
    /// Order of the writes (an identity: claims of one limited queue take it under the
    /// queue's policy row lock, so in lock order).
    pub seq: i64,
    pub intent_id: Uuid,
    pub kind: String,
    /// `clock_timestamp()` of the change, µs.
    pub at_us: i64,
    /// `now()` of its transaction (a claim's `claim_at`, when its tokens are counted), µs.
    pub txn_us: i64,
    /// The transaction's id.
    pub txid: i64,
    /// +1 into LEASED/SUBMITTED, -1 out of them, 0 neither.
    pub delta: i32,
    /// A lease minted: into LEASED, or LEASED again under a new lease id.
    pub minted: bool,
    /// The lease minted.
    pub lease_id: Option<Uuid>,
}

/// The policies set and the database's log of them.
#[derive(Debug, Clone)]
pub struct FlowLog {
    pub limits: QueueLimits,
    /// Every row, by `seq`.
    pub changes: Vec<FlowChange>,
}

/// The database's side of the story after the drain.
#[derive(Debug, Default)]
pub struct Snapshot {
    /// The queue policies set and the database's log of the limited queues (None: the
    /// run set none).
    pub flow: Option<FlowLog>,
    /// Every intent.
    pub intents: HashMap<Uuid, IntentRow>,
    /// Committed producer orders and the intents each linked in its transaction.
    pub committed_orders: HashMap<i64, Vec<Uuid>>,
    /// Every operator decision (the run's operator releases blocked ordering keys).
    pub resolutions: Vec<Resolution>,
}

impl Cluster {
    /// Starts a fresh cluster in `data_dir`, then creates and migrates the outbox database.
    pub async fn start(data_dir: &Path) -> anyhow::Result<Self> {
        let mut config = EmbeddedConfig::new(data_dir);
        // The crash injected is the postmaster's (SIGQUIT), not the kernel's: WAL written
        // to the page cache survives it, so fsync buys nothing here. synchronous_commit
        // stays on, as outboxd forces it on its sessions.
        config.settings = vec![
            ("fsync".into(), "off".into()),
            ("full_page_writes".into(), "off".into()),
            ("max_connections".into(), "200".into()),
        ];
        let postgres = tokio::task::spawn_blocking(move || EmbeddedPostgres::start(config))
            .await?
            .context("starting PostgreSQL")?;
        let setup = PgPool::connect(&postgres.url("postgres")).await?;
        sqlx::query(&format!("CREATE DATABASE {DATABASE}"))
            .execute(&setup)
            .await?;
        setup.close().await;
        let owner_url = postgres.url(DATABASE);
        let options: PgConnectOptions = owner_url.parse()?;
        let admin = PgPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(3))
            .connect_with(options.application_name("outboxd-faults"))
            .await?;
        startup::migrate(&admin).await?;
        startup::grant_service_role(&admin, SERVICE_ROLE, true).await?;
        startup::grant_fleet_role(&admin, FLEET_ROLE, true).await?;
        sqlx::raw_sql(
            r#"
            CREATE SCHEMA faults;
            -- A producer's own rows, written in the same transaction as its Enqueue: after
            -- the run they say which producer transactions committed.
            CREATE TABLE faults.producer_order (
                id bigserial PRIMARY KEY,
                producer text NOT NULL,
                seq bigint NOT NULL
            );
            CREATE TABLE faults.order_intent (
                order_id bigint NOT NULL REFERENCES faults.producer_order (id),
                intent_id uuid PRIMARY KEY
            );
            "#,
        )
        .execute(&admin)
        .await?;
        let keys = Keys {
            producer: create_key(&admin, "faults-producer", &[TENANT], "produce").await?,
            worker: create_key(
                &admin,
                "faults-worker",
                &[TENANT, BACKLOG_TENANT],
                "consume",
            )
            .await?,
            backlog: create_key(&admin, "faults-backlog", &[BACKLOG_TENANT], "produce").await?,
            operator: create_key(&admin, "faults-operator", &[TENANT], "admin").await?,
        };
        let service_url = format!(
            "postgres://{SERVICE_ROLE}@127.0.0.1:{}/{DATABASE}",
            postgres.port()
        );
        let fleet_url = format!(
            "postgres://{FLEET_ROLE}@127.0.0.1:{}/{DATABASE}",
            postgres.port()
        );
        Ok(Self {
            postgres: Arc::new(Mutex::new(postgres)),
            admin,
            owner_url,
            service_url,
            fleet_url,
            keys,
            limits: None,
        })
    }

    /// Sets the queue policies of `limits` for the run's tenant (as an operator inserting
    /// the rows would) and installs the log the limit checks read: an AFTER ROW trigger on
    /// `outbox.intent` (SECURITY DEFINER: it writes as the owner whoever changes the row)
    /// that records, in the changing transaction, each move of an intent of a limited kind
    /// into or out of LEASED/SUBMITTED with `clock_timestamp()`, and each lease minted with
    /// its transaction's `now()`, the instant a claim counts its tokens at. Leases of the
    /// unlimited kind are logged too, for the fairness check.
    pub async fn limit_queues(&mut self, limits: QueueLimits) -> anyhow::Result<()> {
        sqlx::raw_sql(&format!(
            r#"
            CREATE TABLE faults.flow_log (
                seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                intent_id uuid NOT NULL,
                kind text NOT NULL,
                at timestamptz NOT NULL,
                txn_at timestamptz NOT NULL,
                txid bigint NOT NULL,
                delta int NOT NULL,
                minted boolean NOT NULL,
                lease_id uuid
            );
            CREATE FUNCTION faults.log_flow() RETURNS trigger
            LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog AS $$
            DECLARE
                k text := CASE WHEN TG_OP = 'DELETE' THEN OLD.kind ELSE NEW.kind END;
                intent uuid := CASE WHEN TG_OP = 'DELETE' THEN OLD.id ELSE NEW.id END;
                before int := CASE WHEN TG_OP <> 'INSERT'
                                    AND OLD.state IN ('leased', 'submitted') THEN 1 ELSE 0 END;
                after int := CASE WHEN TG_OP <> 'DELETE'
                                   AND NEW.state IN ('leased', 'submitted') THEN 1 ELSE 0 END;
                minted boolean := TG_OP <> 'DELETE' AND NEW.state = 'leased'
                    AND (TG_OP = 'INSERT' OR OLD.state <> 'leased'
                         OR OLD.lease_id IS DISTINCT FROM NEW.lease_id);
            BEGIN
                IF k IN ('{c}', '{r}', '{u}') AND (after <> before OR minted) THEN
                    INSERT INTO faults.flow_log
                        (intent_id, kind, at, txn_at, txid, delta, minted, lease_id)
                    VALUES (intent, k, clock_timestamp(), now(),
                            pg_current_xact_id()::text::bigint,
                            after - before, minted, CASE WHEN minted THEN NEW.lease_id END);
                END IF;
                RETURN NULL;
            END
            $$;
            CREATE TRIGGER faults_log_flow AFTER INSERT OR UPDATE OR DELETE ON outbox.intent
                FOR EACH ROW EXECUTE FUNCTION faults.log_flow();
            INSERT INTO outbox.queue_policy
                (tenant_id, kind, max_in_flight, updated_by, reason, updated_at)
            VALUES ('{TENANT}', '{c}', {max}, 'outboxd-faults', 'fault suite: concurrency limit', now());
            INSERT INTO outbox.queue_policy
                (tenant_id, kind, rate_per_second, burst, updated_by, reason, updated_at)
            VALUES ('{TENANT}', '{r}', {rate}, {burst}, 'outboxd-faults', 'fault suite: rate limit', now());
            "#,
            c = limits.concurrency_kind,
            r = limits.rate_kind,
            u = crate::NOTICE_KIND,
            max = limits.max_in_flight,
            rate = limits.rate_per_second,
            burst = limits.burst,
        ))
        .execute(&self.admin)
        .await
        .context("setting the queue policies")?;
        self.limits = Some(limits);
        Ok(())
    }

    /// Crashes the postmaster (SIGQUIT: immediate shutdown, no checkpoint).
    pub async fn crash(&self) -> anyhow::Result<()> {
        let postgres = self.postgres.clone();
        tokio::task::spawn_blocking(move || {
            postgres
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .crash()
        })
        .await??;
        Ok(())
    }

    /// Starts it again (crash recovery) and waits until it accepts connections.
    pub async fn restart(&self) -> anyhow::Result<()> {
        let postgres = self.postgres.clone();
        tokio::task::spawn_blocking(move || {
            postgres
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .restart()
        })
        .await??;
        Ok(())
    }

    /// Stops it cleanly.
    pub async fn stop(&self) -> anyhow::Result<()> {
        self.admin.close().await;
        let postgres = self.postgres.clone();
        tokio::task::spawn_blocking(move || {
            postgres
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .stop()
        })
        .await??;
        Ok(())
    }

    /// The server log, for the report when something fails.
    pub fn log_path(&self) -> std::path::PathBuf {
        self.postgres
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .log_path()
    }

    /// Terminates the backends whose `application_name` is `application` (and, with
    /// `idle_in_transaction`, only those inside a transaction). Returns how many.
    pub async fn terminate_backends(
        &self,
        application: &str,
        idle_in_transaction: bool,
        limit: i64,
    ) -> anyhow::Result<u64> {
        let killed: i64 = sqlx::query_scalar(
            r#"
            SELECT count(*) FILTER (WHERE pg_terminate_backend(pid))
            FROM (
                SELECT pid FROM pg_stat_activity
                WHERE application_name = $1
                  AND (NOT $2 OR state = 'idle in transaction')
                ORDER BY random()
                LIMIT $3
            ) AS chosen
            "#,
        )
        .bind(application)
        .bind(idle_in_transaction)
        .bind(limit)
        .fetch_one(&self.admin)
        .await?;
        Ok(killed as u64)
    }

    /// Locks up to `limit` LEASED or SUBMITTED intents (`FOR UPDATE`) for `hold`, as a
    /// long transaction would: Acks and Fails on them wait, holding their connections.
    /// Returns how many rows were locked.
    pub async fn lock_rows(&self, limit: i64, hold: Duration) -> anyhow::Result<i64> {
        let mut tx = self.admin.begin().await?;
        let locked: i64 = sqlx::query_scalar(
            r#"
            WITH locked AS (
                SELECT id FROM outbox.intent
                WHERE state IN ('leased', 'submitted')
                ORDER BY random()
                LIMIT $1
                FOR UPDATE
            )
            SELECT count(*) FROM locked
            "#,
        )
        .bind(limit)
        .fetch_one(&mut *tx)
        .await?;
        tokio::time::sleep(hold).await;
        tx.rollback().await?;
        Ok(locked)
    }

    /// How many intents are still in a live state (STAGED, PENDING, LEASED, SUBMITTED, or
    /// WAITING behind an earlier intent of their ordering key).
    pub async fn live_intents(&self) -> anyhow::Result<i64> {
        let live = sqlx::query_scalar(
            "SELECT count(*) FROM outbox.intent \
             WHERE state IN ('staged', 'pending', 'leased', 'submitted', 'waiting')",
        )
        .fetch_one(&self.admin)
        .await?;
        Ok(live)
    }

    /// Live intents by state, for a drain that did not finish.
    pub async fn live_breakdown(&self) -> anyhow::Result<Vec<(String, i64)>> {
        Ok(sqlx::query_as(
            "SELECT state::text, count(*) FROM outbox.intent \
             WHERE state IN ('staged', 'pending', 'leased', 'submitted', 'waiting') \
             GROUP BY 1 ORDER BY 1",
        )
        .fetch_all(&self.admin)
        .await?)
    }

    /// Ordered intents that hold their key until an operator decides, with intents of the
    /// key WAITING behind them (`run::operator` releases them).
    pub async fn blocked_heads(&self) -> anyhow::Result<Vec<BlockedHead>> {
        Ok(sqlx::query_as(
            r#"
            SELECT h.id, h.state::text AS state,
                   (extract(epoch FROM now() - h.updated_at) * 1000)::bigint AS age_ms
            FROM outbox.intent h
            WHERE h.ordering_key IS NOT NULL
              AND (h.state = 'needs_reconcile'
                   OR (h.state = 'dead_lettered' AND h.finished_at IS NULL))
              AND EXISTS (
                  SELECT 1 FROM outbox.intent w
                  WHERE w.tenant_id = h.tenant_id
                    AND w.ordering_key = h.ordering_key
                    AND w.state = 'waiting'
              )
            "#,
        )
        .fetch_all(&self.admin)
        .await?)
    }

    /// Every intent and every committed producer order.
    pub async fn snapshot(&self) -> anyhow::Result<Snapshot> {
        // As superuser: row-level security does not apply, every tenant's rows are read.
        let rows: Vec<IntentRow> = sqlx::query_as(
            r#"
            SELECT id, tenant_id, kind, state::text AS state, attempts, max_attempts,
                   CASE WHEN txn_xid IS NOT NULL THEN pg_xact_status(txn_xid) END AS xact,
                   -- A direct ordered intent carries outboxd's own transaction as its
                   -- txn_xid: the producers' idempotency keys tell the two apart
                   -- (`{producer}/t{seq}/{i}` for a two-phase one, `…/d…` or none direct).
                   txn_xid IS NOT NULL
                       AND (ordering_key IS NULL
                            OR coalesce(split_part(idempotency_key, '/', 2) LIKE 't%', false))
                       AS two_phase,
                   txn_xid::text AS txn_xid, lease_id, last_error, ordering_key, order_seq,
                   (extract(epoch FROM created_at) * 1000000)::bigint AS created_us,
                   (extract(epoch FROM finished_at) * 1000000)::bigint AS finished_us,
                   CASE WHEN (ordering_key IS NOT NULL OR kind = $1) AND state <> 'discarded' THEN
                       (extract(epoch FROM outbox.commit_time(txn_xid)) * 1000000)::bigint
                   END AS commit_us
            FROM outbox.all_intents
            "#,
        )
        .bind(crate::NOTICE_KIND)
        .fetch_all(&self.admin)
        .await?;
        let links: Vec<(i64, Uuid)> =
            sqlx::query_as("SELECT order_id, intent_id FROM faults.order_intent")
                .fetch_all(&self.admin)
                .await?;
        let mut snapshot = Snapshot {
            intents: rows.into_iter().map(|r| (r.id, r)).collect(),
            ..Snapshot::default()
        };
        for (order, intent) in links {
            snapshot
                .committed_orders
                .entry(order)
                .or_default()
                .push(intent);
        }
        // Orders committed without links cannot exist (a producer links before COMMIT),
        // but an order row alone would still be a committed transaction: count it too.
        let orders: Vec<i64> = sqlx::query_scalar("SELECT id FROM faults.producer_order")
            .fetch_all(&self.admin)
            .await?;
        for order in orders {
            snapshot.committed_orders.entry(order).or_default();
        }
        if let Some(limits) = self.limits {
            let changes = sqlx::query_as(
                r#"
                SELECT seq, intent_id, kind,
                       (extract(epoch FROM at) * 1000000)::bigint AS at_us,
                       (extract(epoch FROM txn_at) * 1000000)::bigint AS txn_us,
                       txid, delta, minted, lease_id
                FROM faults.flow_log ORDER BY seq
                "#,
            )
            .fetch_all(&self.admin)
            .await?;
            snapshot.flow = Some(FlowLog { limits, changes });
        }
        snapshot.resolutions = sqlx::query_as(
            r#"
            SELECT intent_id, decision FROM outbox.resolution
            "#,
        )
        .fetch_all(&self.admin)
        .await?;
        Ok(snapshot)
    }
}

async fn create_key(
    pool: &PgPool,
    name: &str,
    tenants: &[&str],
    scope: &str,
) -> anyhow::Result<String> {
    let tenants = Some(tenants.iter().map(|t| (*t).to_owned()).collect());
    let (_, secret) =
        outboxd::auth::issue_key(pool, name, tenants, vec![scope.to_owned()], vec![]).await?;
    Ok(secret)
}
