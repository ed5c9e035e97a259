//! Whom a transaction acts for. Every statement outboxd runs on behalf of a caller runs in
//! a transaction that first sets `outbox.tenants` and its proof, `outbox.scope_proof`; the
//! row-level security policies of the outbox tables read the tenants only when the proof
//! holds (docs/tenancy.md). Work for every tenant runs on another connection altogether,
//! as a role granted every tenant (`outboxd_fleet`): the pool is chosen here, from the
//! scope, so that no call site can pick the wrong one.

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use sha2::{Digest, Sha256};
use sqlx::pool::PoolConnection;
use sqlx::{PgPool, Postgres, Transaction};

use crate::outbox::Result;

/// The tenants a transaction may see and write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TenantScope {
    /// These tenants only (at least one).
    Tenants(Vec<String>),
    /// Every tenant: sweeps, fleet workers and admins granted all tenants.
    All,
}

impl TenantScope {
    /// One tenant.
    pub fn one(tenant: impl Into<String>) -> Self {
        Self::Tenants(vec![tenant.into()])
    }

    /// The single tenant new rows belong to, if the scope names exactly one.
    pub fn single(&self) -> Option<&str> {
        match self {
            Self::Tenants(t) if t.len() == 1 => Some(&t[0]),
            _ => None,
        }
    }
}

/// The two pools outboxd holds. `tenant`'s role sees only the tenants a transaction names
/// in `outbox.tenants` (it serves requests of keys bound to tenants, and what reads no
/// tenant's rows: API keys, notifications); `fleet`'s role is a member of `outboxd_fleet`,
/// whose policies show it every tenant, and runs [`TenantScope::All`] work only (sweeps,
/// promotion, queue gauges, keys bound to all tenants). The tenant role is no member of
/// `outboxd_fleet` (`crate::startup::verify_service_role`): no setting of its sessions
/// opens another tenant, whatever a bug or an injection in outboxd makes them run.
#[derive(Debug, Clone)]
pub struct Pools {
    tenant: PgPool,
    fleet: PgPool,
    scope_key: ScopeKey,
    /// What the tenant and the fleet pool's acquires count, when the caller hands counters.
    acquires: Option<Arc<[AcquireCounters; 2]>>,
}

/// What acquiring a connection for a transaction counts: how long it took, and how many
/// wait for one now (a pool too small for the load shows here first).
#[derive(Debug, Clone)]
pub struct AcquireCounters {
    /// Seconds each acquire took.
    pub seconds: Histogram,
    /// Acquires waiting now.
    pub waiting: Gauge,
}

impl Pools {
    /// The request-serving pool and the fleet pool, with the secret that proves scopes,
    /// read through the fleet pool.
    ///
    /// # Errors
    /// [`crate::outbox::Error::Database`]: the secret cannot be read.
    pub async fn open(tenant: PgPool, fleet: PgPool) -> Result<Self> {
        let scope_key = ScopeKey::load(&fleet).await?;
        Ok(Self {
            tenant,
            fleet,
            scope_key,
            acquires: None,
        })
    }

    /// These pools, counting the acquires of their transactions' connections into
    /// `tenant` and `fleet`.
    pub fn with_acquire_counters(
        mut self,
        tenant: AcquireCounters,
        fleet: AcquireCounters,
    ) -> Self {
        self.acquires = Some(Arc::new([tenant, fleet]));
        self
    }

    /// The counters of the pool that acts for `scope`, if any.
    fn acquire_counters(&self, scope: &TenantScope) -> Option<AcquireCounters> {
        let acquires = self.acquires.as_deref()?;
        Some(match scope {
            TenantScope::Tenants(_) => acquires[0].clone(),
            TenantScope::All => acquires[1].clone(),
        })
    }

    /// A connection of the pool that acts for `scope`, its wait counted as a transaction's
    /// is (`outbox_db_pool_acquire_seconds`): for the calls that are one statement.
    pub(super) async fn acquire(
        &self,
        scope: &TenantScope,
    ) -> sqlx::Result<PoolConnection<Postgres>> {
        acquire_counted(self.for_scope(scope), self.acquire_counters(scope).as_ref()).await
    }

    /// The settings that scope a transaction to `scope`: the tenants and their proof
    /// (both empty for every tenant, which is the fleet role's grant).
    pub(super) fn scope_settings(&self, scope: &TenantScope) -> ScopeSettings {
        match scope {
            TenantScope::Tenants(t) => {
                let tenants = t.join(",");
                let proof = self.scope_key.proof(&tenants);
                ScopeSettings { tenants, proof }
            }
            TenantScope::All => ScopeSettings::default(),
        }
    }

    /// The request-serving role's pool: for what acts for named tenants, or reads no
    /// tenant's rows.
    pub fn tenant(&self) -> &PgPool {
        &self.tenant
    }

    /// The fleet role's pool, which sees every tenant.
    pub fn fleet(&self) -> &PgPool {
        &self.fleet
    }

    /// The pool whose role may act for `scope`: the one place that chooses.
    pub fn for_scope(&self, scope: &TenantScope) -> &PgPool {
        match scope {
            TenantScope::Tenants(_) => &self.tenant,
            TenantScope::All => &self.fleet,
        }
    }

    /// Closes both pools.
    pub async fn close(&self) {
        self.tenant.close().await;
        self.fleet.close().await;
    }
}

/// The values of `outbox.tenants` and `outbox.scope_proof` for a scope.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct ScopeSettings {
    pub tenants: String,
    pub proof: String,
}

/// The secret of `outbox.scope_secret`, which the request-serving role cannot read: with
/// it outboxd proves the tenants a transaction names (`outbox.current_tenants()`).
#[derive(Clone)]
pub struct ScopeKey(Arc<[u8]>);

impl std::fmt::Debug for ScopeKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ScopeKey(..)")
    }
}

impl ScopeKey {
    /// Reads the secret, as a role that may (the fleet's, or the schema owner).
    ///
    /// # Errors
    /// [`crate::outbox::Error::Database`].
    pub async fn load(pool: &PgPool) -> Result<Self> {
        let secret: Vec<u8> = on_live_connection(pool, || {
            sqlx::query_scalar("SELECT secret FROM outbox.scope_secret").fetch_one(pool)
        })
        .await?;
        Ok(Self(secret.into()))
    }

    /// The proof of `tenants` (comma-separated), as `outbox.current_tenants()` checks it:
    /// hex(sha256(secret ‖ sha256(secret ‖ tenants))).
    pub fn proof(&self, tenants: &str) -> String {
        let inner = Sha256::new()
            .chain_update(&self.0)
            .chain_update(tenants.as_bytes())
            .finalize();
        hex::encode(
            Sha256::new()
                .chain_update(&self.0)
                .chain_update(inner)
                .finalize(),
        )
    }
}

/// A statement that rides along with BEGIN, in the same round trip.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AlsoAtBegin {
    /// Reuse one plan per statement and connection instead of planning every execution:
    /// planning (the row-level security policy included) cost about as much PostgreSQL
    /// CPU as running a statement. Only for statements whose best plan depends neither on
    /// their parameters nor on the table's size (enqueue; the claim and settle functions set
    /// the same for themselves, with their index conditions written to hold whatever the
    /// statistics: joined to a batch of ids, a plan made on a small table was a merge join
    /// over the whole primary key, kept for the connection's life); always with
    /// [`Self::IndexPlans`].
    GenericPlans,
    /// Plan with index scans only. A backlog or a table that grew since the last ANALYZE
    /// otherwise gets a bitmap scan and a sort of the whole backlog per claim (~110 ms at
    /// 200k pending), a sequential scan of the table per sweep (~13 ms at 100k rows,
    /// ten times a second) or per settle (a young table's Ack at 1000/s: 2.6 ms a call
    /// instead of 0.26 through the primary key), and a generic plan made on a near-empty
    /// table would keep one.
    IndexPlans,
    /// The transaction's Enqueue statements register their intents' levels themselves
    /// (their `levels` CTE), so the insert trigger that does it for every other insert
    /// skips them: its transition table and call cost an Enqueue ~0.05 ms
    /// (`outbox.register_queue_levels`, migration `…02_baseline_functions`).
    LevelsRegistered,
    /// PostgreSQL cancels a statement that runs longer (an operator call's filter that
    /// matches little of a large table): the transaction changes nothing, and the call is
    /// answered `STATEMENT_TIMEOUT`.
    StatementTimeout(std::time::Duration),
}

impl AlsoAtBegin {
    /// Appends the statements to a simple-protocol query.
    fn append_to(self, sql: &mut String) {
        match self {
            Self::GenericPlans => sql.push_str("; SET LOCAL plan_cache_mode = force_generic_plan"),
            Self::IndexPlans => {
                sql.push_str("; SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off");
            }
            Self::LevelsRegistered => sql.push_str("; SET LOCAL outbox.levels_registered = on"),
            Self::StatementTimeout(limit) => {
                // 0 would mean none; past PostgreSQL's largest the BEGIN would fail, and
                // sqlx would give the pool back a connection in a failed transaction.
                let ms = limit.as_millis().clamp(1, i32::MAX as u128);
                sql.push_str(&format!("; SET LOCAL statement_timeout = {ms}"));
            }
        }
    }
}

/// Begins a transaction scoped to `scope`, on the pool whose role may act for it
/// ([`Pools::for_scope`]). The settings are transaction-local (`set_config(…, true)`), so
/// they end with it and never leak through the pool.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn begin(pools: &Pools, scope: &TenantScope) -> Result<Transaction<'static, Postgres>> {
    begin_with(pools, scope, &[]).await
}

/// [`begin`], with `also` run in the same round trip as BEGIN.
///
/// BEGIN and `also` go as one simple-protocol query; the scope follows as a statement of
/// its own, its proof bound as a parameter: SQL text shows in `pg_stat_activity` to every
/// session of the role, and a proof seen there would open its tenants to them. Work for
/// every tenant sets nothing: its role's grant is its scope.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn begin_with(
    pools: &Pools,
    scope: &TenantScope,
    also: &[AlsoAtBegin],
) -> Result<Transaction<'static, Postgres>> {
    let pool = pools.for_scope(scope);
    let mut begin = String::from("BEGIN");
    for a in also {
        a.append_to(&mut begin);
    }
    let counters = pools.acquire_counters(scope);
    let mut tx = begin_on_live_connection(pool, begin, counters).await?;
    if let TenantScope::Tenants(_) = scope {
        let settings = pools.scope_settings(scope);
        sqlx::query("SELECT outbox.enter_scope($1, $2)")
            .bind(settings.tenants)
            .bind(settings.proof)
            .execute(&mut *tx)
            .await?;
    }
    Ok(tx)
}

/// Begins a transaction with `statement` (BEGIN and what rides along); see
/// [`on_live_connection`].
///
/// In a task of its own, which a caller that goes away (a cancelled RPC) cannot stop half
/// way: sqlx counts a transaction as begun only once BEGIN is answered, so a BEGIN dropped
/// in flight would queue no ROLLBACK, and the pool would take the connection back inside a
/// transaction nobody owns. The next one-statement calls there (Ack, MarkSubmitted, …)
/// would run inside it and be answered before anything committed. Finished in its task, a
/// transaction nobody takes is dropped like any other, and sqlx rolls it back.
async fn begin_on_live_connection(
    pool: &PgPool,
    statement: String,
    counters: Option<AcquireCounters>,
) -> Result<Transaction<'static, Postgres>> {
    let pool = pool.clone();
    let begin = tokio::spawn(async move {
        on_live_connection(&pool, || async {
            let connection = acquire_counted(&pool, counters.as_ref()).await?;
            // What `PgPool::begin_with` does, with the acquire timed on its own: the BEGIN
            // is a round trip whatever the pool's state, the acquire is what a pool too
            // small makes wait.
            Transaction::begin(connection, Some(statement.clone().into())).await
        })
        .await
    });
    match begin.await {
        Ok(begun) => Ok(begun?),
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        // The runtime is shutting down.
        Err(_) => Err(sqlx::Error::PoolClosed.into()),
    }
}

/// Runs `call`, the first round trip on a connection from `pool`, again (on another
/// connection) when it failed because the pool handed out one that died while idle
/// (PostgreSQL restarted, or terminated it). Bounded by the pool size, since after a
/// restart every idle connection may be dead. A BEGIN that failed so did nothing; a call
/// that is a whole transaction may have committed just before the connection died, and its
/// caller says why running it again is safe.
pub(super) async fn on_live_connection<T, F, Fut>(pool: &PgPool, mut call: F) -> sqlx::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = sqlx::Result<T>>,
{
    let mut tries = pool.options().get_max_connections() + 1;
    loop {
        match call().await {
            Err(e) if tries > 1 && is_dead_connection(&e) => tries -= 1,
            done => return done,
        }
    }
}

/// A connection from `pool`, the wait counted into `counters`.
async fn acquire_counted(
    pool: &PgPool,
    counters: Option<&AcquireCounters>,
) -> sqlx::Result<PoolConnection<Postgres>> {
    let Some(counters) = counters else {
        return pool.acquire().await;
    };
    /// Takes the acquire off `waiting` however it ends.
    struct Waiting<'a>(&'a Gauge);
    impl Drop for Waiting<'_> {
        fn drop(&mut self) {
            self.0.dec();
        }
    }
    let started = Instant::now();
    counters.waiting.inc();
    let waiting = Waiting(&counters.waiting);
    let connection = pool.acquire().await;
    drop(waiting);
    counters.seconds.observe(started.elapsed().as_secs_f64());
    connection
}

/// The connection is gone: closed under us, or PostgreSQL said it is shutting it down.
fn is_dead_connection(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_) => true,
        // 57P01 admin_shutdown, 57P02 crash_shutdown, 57P03 cannot_connect_now.
        sqlx::Error::Database(db) => {
            matches!(db.code().as_deref(), Some("57P01" | "57P02" | "57P03"))
        }
        _ => false,
    }
}
