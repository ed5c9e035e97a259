//! API keys: created, listed and revoked by the operator CLI with the schema owner's
//! connection; looked up (read-only) by the server on every call.

use chrono::{DateTime, Utc};
use sqlx::{PgExecutor, PgPool};
use uuid::Uuid;

use super::access::on_live_connection;
use crate::outbox::Result;

/// A stored API key (never the secret, only its hash).
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct ApiKeyRecord {
    /// Key id.
    pub id: Uuid,
    /// Human label.
    pub name: String,
    /// First characters of the secret.
    pub prefix: String,
    /// Tenants it acts for (ignored when `all_tenants`).
    pub tenants: Vec<String>,
    /// Acts for every tenant.
    pub all_tenants: bool,
    /// `produce`, `consume`, `operate`, `admin`.
    pub scopes: Vec<String>,
    /// Regions it is limited to (empty: any).
    pub regions: Vec<String>,
    /// Created at.
    pub created_at: DateTime<Utc>,
    /// Revoked at, if revoked.
    pub revoked_at: Option<DateTime<Utc>>,
}

/// Stores a new key.
///
/// # Errors
/// [`crate::outbox::Error::Database`], e.g. an unknown scope (CHECK constraint).
pub async fn insert_api_key(
    db: impl PgExecutor<'_>,
    record: &ApiKeyRecord,
    key_hash: &[u8],
) -> Result<()> {
    sqlx::query(
        r#"
        INSERT INTO outbox.api_key (id, name, prefix, key_hash, tenants, all_tenants, scopes,
                                    regions, created_at)
        VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
        "#,
    )
    .bind(record.id)
    .bind(&record.name)
    .bind(&record.prefix)
    .bind(key_hash)
    .bind(&record.tenants)
    .bind(record.all_tenants)
    .bind(&record.scopes)
    .bind(&record.regions)
    .bind(record.created_at)
    .execute(db)
    .await?;
    Ok(())
}

/// Stores a key unless one with the same hash is stored already (live or revoked: a
/// revoked key is never brought back). Returns whether it was stored now.
///
/// # Errors
/// [`crate::outbox::Error::Database`], e.g. an unknown scope (CHECK constraint).
pub async fn insert_api_key_unless_stored(
    db: impl PgExecutor<'_>,
    record: &ApiKeyRecord,
    key_hash: &[u8],
) -> Result<bool> {
    let inserted = sqlx::query(
        r#"
        INSERT INTO outbox.api_key (id, name, prefix, key_hash, tenants, all_tenants, scopes,
                                    regions, created_at)
        VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
        ON CONFLICT (key_hash) DO NOTHING
        "#,
    )
    .bind(record.id)
    .bind(&record.name)
    .bind(&record.prefix)
    .bind(key_hash)
    .bind(&record.tenants)
    .bind(record.all_tenants)
    .bind(&record.scopes)
    .bind(&record.regions)
    .bind(record.created_at)
    .execute(db)
    .await?
    .rows_affected();
    Ok(inserted == 1)
}

/// The live (not revoked) key with this hash.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn find_api_key(
    db: impl PgExecutor<'_>,
    key_hash: &[u8],
) -> Result<Option<ApiKeyRecord>> {
    Ok(select_api_key(db, key_hash).await?)
}

/// [`find_api_key`] on a connection from `pool`, again on another when the pool handed out
/// one that died while idle (a read: running it twice is harmless). It is every request's
/// first statement, and since the sweeps run on the fleet pool nothing else may have met
/// the request pool's dead connections first after PostgreSQL restarted.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn lookup_api_key(pool: &PgPool, key_hash: &[u8]) -> Result<Option<ApiKeyRecord>> {
    Ok(on_live_connection(pool, || select_api_key(pool, key_hash)).await?)
}

async fn select_api_key(
    db: impl PgExecutor<'_>,
    key_hash: &[u8],
) -> sqlx::Result<Option<ApiKeyRecord>> {
    sqlx::query_as(
        r#"
        SELECT id, name, prefix, tenants, all_tenants, scopes, regions, created_at, revoked_at
        FROM outbox.api_key
        WHERE key_hash = $1
          AND revoked_at IS NULL
        "#,
    )
    .bind(key_hash)
    .fetch_optional(db)
    .await
}

/// Every key, newest first.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn list_api_keys(db: impl PgExecutor<'_>) -> Result<Vec<ApiKeyRecord>> {
    let records = sqlx::query_as(
        r#"
        SELECT id, name, prefix, tenants, all_tenants, scopes, regions, created_at, revoked_at
        FROM outbox.api_key
        ORDER BY created_at DESC
        "#,
    )
    .fetch_all(db)
    .await?;
    Ok(records)
}

/// Revokes the one active key of this id or name; returns how many active keys matched
/// (several: none was revoked).
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn revoke_api_key(db: impl PgExecutor<'_>, id_or_name: &str) -> Result<u64> {
    // Names are not unique (a rotation stores the new key under the old one's name): a
    // name that matches several active keys revokes none of them.
    let matched: i64 = sqlx::query_scalar(
        r#"
        WITH target AS (
            SELECT id FROM outbox.api_key
            WHERE (id::text = $1 OR name = $1)
              AND revoked_at IS NULL
            FOR UPDATE
        ), revoked AS (
            UPDATE outbox.api_key k
            SET revoked_at = now()
            FROM target
            WHERE k.id = target.id
              AND (SELECT count(*) FROM target) = 1
        )
        SELECT count(*) FROM target
        "#,
    )
    .bind(id_or_name)
    .fetch_one(db)
    .await?;
    Ok(u64::try_from(matched).unwrap_or(0))
}
