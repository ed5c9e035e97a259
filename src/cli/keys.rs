//! `outboxd keys`: API keys created, listed and revoked directly in the database, as the
//! schema owner (the service role may read keys, never mint them).

use anyhow::Context;
use serde_json::{Value, json};

use super::KeysCommand;
use crate::auth;
use crate::config::Settings;
use crate::outbox::store;
use crate::startup;

pub(super) async fn run(settings: Settings, command: KeysCommand) -> anyhow::Result<()> {
    let (embedded, url) = startup::owner_database(&settings).await?;
    let pool = startup::connect(&url, 2).await?;
    let result = match migrated(&pool).await {
        Ok(()) => run_keys(&pool, command).await,
        Err(e) => Err(e),
    };
    pool.close().await;
    super::server::stop_embedded(embedded).await?;
    result.map_err(|e| startup::with_owner_hint(&settings, e))
}

/// Keys live in the schema `outboxd migrate` makes: without it, say so (not a missing
/// relation).
async fn migrated(pool: &sqlx::PgPool) -> anyhow::Result<()> {
    let has_keys: bool = sqlx::query_scalar("SELECT to_regclass('outbox.api_key') IS NOT NULL")
        .fetch_one(pool)
        .await?;
    anyhow::ensure!(
        has_keys,
        "this database has no outboxd schema yet: run `outboxd migrate` (or start `outboxd \
         serve` once, which migrates) with the same settings first"
    );
    Ok(())
}

/// What `keys create --secret-from-env` did; never the secret, which the caller has.
fn print_supplied(record: &store::ApiKeyRecord, stored: bool, json: bool) -> anyhow::Result<()> {
    if json {
        let id = stored.then_some(record.id);
        let value =
            json!({ "name": record.name, "prefix": record.prefix, "stored": stored, "id": id });
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else if stored {
        println!(
            "stored key {:?} ({}, {}…)",
            record.name, record.id, record.prefix
        );
    } else {
        // Scopes and tenants are not updated either: a key's grants change by a new key.
        println!(
            "key {}… is stored already (perhaps revoked); left as it is",
            record.prefix
        );
    }
    Ok(())
}

async fn run_keys(pool: &sqlx::PgPool, command: KeysCommand) -> anyhow::Result<()> {
    match command {
        KeysCommand::Create {
            name,
            tenants,
            all_tenants,
            scopes,
            regions,
            secret_from_env,
            json,
        } => {
            if let Some(why) = auth::key_name_problem(&name) {
                anyhow::bail!("--name {name:?}: {why}");
            }
            for tenant in &tenants {
                anyhow::ensure!(
                    crate::outbox::is_name(tenant, 64),
                    "tenant {tenant:?} must be 1-64 ASCII letters, digits or . _ - : /"
                );
            }
            for region in &regions {
                anyhow::ensure!(
                    crate::outbox::is_name(region, 64),
                    "region {region:?} is not a valid name"
                );
            }
            let tenants = (!all_tenants).then_some(tenants);
            if let Some(variable) = secret_from_env {
                let secret = std::env::var(&variable)
                    .with_context(|| format!("--secret-from-env: ${variable} is not set"))?;
                let key = auth::supplied_key(secret.trim())
                    .with_context(|| format!("--secret-from-env: ${variable}"))?;
                let (record, stored) =
                    auth::store_supplied_key(pool, &key, &name, tenants, scopes, regions).await?;
                return print_supplied(&record, stored, json);
            }
            let (record, secret) = auth::issue_key(pool, &name, tenants, scopes, regions).await?;
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&json!({
                        "id": record.id, "name": record.name, "api_key": secret,
                    }))?
                );
            } else {
                println!("{secret}");
                eprintln!(
                    "created key {:?} ({}); the secret above is shown only once",
                    record.name, record.id
                );
            }
            Ok(())
        }
        KeysCommand::List { json } => {
            let keys = store::list_api_keys(pool).await?;
            if json {
                let keys: Vec<Value> = keys
                    .iter()
                    .map(|k| {
                        json!({
                            "id": k.id, "name": k.name, "prefix": k.prefix, "tenants": k.tenants,
                            "all_tenants": k.all_tenants, "scopes": k.scopes, "regions": k.regions,
                            "created_at": k.created_at, "revoked_at": k.revoked_at,
                        })
                    })
                    .collect();
                println!("{}", serde_json::to_string_pretty(&keys)?);
            } else {
                println!(
                    "{:<36}  {:<20} {:<14} {:<24} {:<28} {:<16} STATUS",
                    "ID", "NAME", "PREFIX", "TENANTS", "SCOPES", "REGIONS"
                );
                for k in keys {
                    let tenants = if k.all_tenants {
                        "*".to_owned()
                    } else {
                        k.tenants.join(",")
                    };
                    let status = if k.revoked_at.is_some() {
                        "revoked"
                    } else {
                        "active"
                    };
                    let regions = if k.regions.is_empty() {
                        "*".to_owned()
                    } else {
                        k.regions.join(",")
                    };
                    println!(
                        "{:<36}  {:<20} {:<14} {:<24} {:<28} {:<16} {status}",
                        k.id,
                        k.name,
                        k.prefix,
                        tenants,
                        k.scopes.join(","),
                        regions
                    );
                }
            }
            Ok(())
        }
        KeysCommand::Revoke { key } => {
            match store::revoke_api_key(pool, &key).await? {
                0 => anyhow::bail!("no active key with id or name {key:?}"),
                1 => {}
                n => anyhow::bail!(
                    "{n} active keys are named {key:?}; none was revoked: revoke one by its id \
                     (outboxd keys list)"
                ),
            }
            println!("revoked 1 key; servers stop accepting it within OUTBOX_AUTH__CACHE_TTL");
            Ok(())
        }
    }
}
