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

/// Tenant of every intent of the run.
pub const TENANT: &str = "faults";

/// API keys of the run, one per actor.
#[derive(Debug, Clone)]
pub struct Keys {
    /// `produce` scope.
    pub producer: String,
    /// `consume` scope.
    pub worker: String,
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
}

/// One intent as the database has it at the end.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct IntentRow {
    pub id: Uuid,
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
}

/// The database's side of the story after the drain.
#[derive(Debug, Default)]
pub struct Snapshot {
    /// Every intent.
    pub intents: HashMap<Uuid, IntentRow>,
    /// Committed producer orders and the intents each linked in its transaction.
    pub committed_orders: HashMap<i64, Vec<Uuid>>,
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
            producer: create_key(&admin, "faults-producer", "produce").await?,
            worker: create_key(&admin, "faults-worker", "consume").await?,
            operator: create_key(&admin, "faults-operator", "admin").await?,
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
        })
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

    /// How many intents are still in a live state (STAGED, PENDING, LEASED, SUBMITTED).
    pub async fn live_intents(&self) -> anyhow::Result<i64> {
        let live = sqlx::query_scalar(
            "SELECT count(*) FROM outbox.intent \
             WHERE state IN ('staged', 'pending', 'leased', 'submitted')",
        )
        .fetch_one(&self.admin)
        .await?;
        Ok(live)
    }

    /// Live intents by state, for a drain that did not finish.
    pub async fn live_breakdown(&self) -> anyhow::Result<Vec<(String, i64)>> {
        Ok(sqlx::query_as(
            "SELECT state::text, count(*) FROM outbox.intent \
             WHERE state IN ('staged', 'pending', 'leased', 'submitted') GROUP BY 1 ORDER BY 1",
        )
        .fetch_all(&self.admin)
        .await?)
    }

    /// Every intent and every committed producer order.
    pub async fn snapshot(&self) -> anyhow::Result<Snapshot> {
        // As superuser: row-level security does not apply, every tenant's rows are read.
        let rows: Vec<IntentRow> = sqlx::query_as(
            r#"
            SELECT id, state::text AS state, attempts, max_attempts,
                   CASE WHEN txn_xid IS NOT NULL THEN pg_xact_status(txn_xid) END AS xact,
                   txn_xid IS NOT NULL AS two_phase, txn_xid::text AS txn_xid, lease_id,
                   last_error
            FROM outbox.all_intents
            "#,
        )
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
        Ok(snapshot)
    }
}

async fn create_key(pool: &PgPool, name: &str, scope: &str) -> anyhow::Result<String> {
    let tenants = Some(vec![TENANT.to_owned()]);
    let (_, secret) =
        outboxd::auth::issue_key(pool, name, tenants, vec![scope.to_owned()], vec![]).await?;
    Ok(secret)
}
