//! Whom a transaction acts for. Every statement outboxd runs on behalf of a caller runs in
//! a transaction that first sets `outbox.tenants` (or, for explicitly cross-tenant work,
//! `outbox.cross_tenant`); the row-level security policies of the outbox tables read them.

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

/// Begins a transaction scoped to `scope`. The settings are transaction-local
/// (`set_config(…, true)`), so they end with it and never leak through the pool.
///
/// # Errors
/// [`crate::outbox::Error::Database`].
pub async fn begin(pool: &PgPool, scope: &TenantScope) -> Result<Transaction<'static, Postgres>> {
    let mut tx = pool.begin().await?;
    let (tenants, cross) = match scope {
        TenantScope::Tenants(t) => (t.join(","), "off"),
        TenantScope::All => (String::new(), "on"),
    };
    sqlx::query(
        "SELECT set_config('outbox.tenants', $1, true), set_config('outbox.cross_tenant', $2, true)",
    )
    .bind(tenants)
    .bind(cross)
    .execute(&mut *tx)
    .await?;
    Ok(tx)
}
