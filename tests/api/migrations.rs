//! The schema's migrations: the 0.1.0 baseline and what follows it, applied by
//! `startup::migrate`, and databases of builds before the baseline refused.

use outboxd::startup;
use sqlx::PgPool;

use crate::helpers::{fresh_database, other_database};

#[tokio::test]
async fn migrating_an_empty_database_and_again_a_migrated_one_succeeds() {
    for url in [other_database().await, fresh_database().await] {
        let pool = PgPool::connect(&url).await.unwrap();
        startup::migrate(&pool).await.unwrap();
        let applied: Vec<i64> =
            sqlx::query_scalar("SELECT version FROM _sqlx_migrations ORDER BY version")
                .fetch_all(&pool)
                .await
                .unwrap();
        let shipped: Vec<i64> = outboxd::MIGRATOR
            .iter()
            .filter(|m| !m.migration_type.is_down_migration())
            .map(|m| m.version)
            .collect();
        assert_eq!(applied, shipped);
        pool.close().await;
    }
}

/// Records migration `version` as applied, as a build that carried it would have.
async fn record_applied(pool: &PgPool, version: i64, description: &str) {
    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
         VALUES ($1, $2, true, '\\x00', 1)",
    )
    .bind(version)
    .bind(description)
    .execute(pool)
    .await
    .unwrap();
}

/// A rollback: the database holds a migration of a newer release, which this binary does
/// not carry; later migrations are additive, so it migrates (nothing to do) and serves.
#[tokio::test]
async fn a_database_a_newer_release_migrated_is_accepted_for_a_rollback() {
    let pool = PgPool::connect(&fresh_database().await).await.unwrap();
    startup::migrate(&pool).await.unwrap();
    record_applied(&pool, 29991231000001, "a newer release").await;
    startup::migrate(&pool).await.unwrap();
    let newest: i64 = sqlx::query_scalar("SELECT max(version) FROM _sqlx_migrations")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(newest, 29991231000001, "left as it was");
    pool.close().await;
}

#[tokio::test]
async fn a_database_migrated_by_a_build_before_the_baseline_is_refused_and_left_alone() {
    let pool = PgPool::connect(&fresh_database().await).await.unwrap();
    // What a build before 0.1.0 left: its first migration recorded, and others after it.
    record_applied(&pool, 20261130000001, "create outbox intent").await;
    let before: i64 = sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations")
        .fetch_one(&pool)
        .await
        .unwrap();

    let refused = startup::migrate(&pool).await.unwrap_err().to_string();
    assert!(refused.contains("pre-0.1.0 build"), "{refused}");
    assert!(refused.contains("20261130000001"), "{refused}");
    assert!(refused.contains("recreate it"), "{refused}");
    let after: i64 = sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(after, before, "nothing migrated");
}

#[tokio::test]
async fn the_baselines_down_migrations_undo_it_and_it_migrates_again() {
    let pool = PgPool::connect(&fresh_database().await).await.unwrap();
    outboxd::MIGRATOR.undo(&pool, 0).await.unwrap();
    let left: Vec<String> = sqlx::query_scalar(
        "SELECT nspname::text FROM pg_namespace WHERE nspname = 'outbox'
         UNION ALL SELECT version::text FROM _sqlx_migrations",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(left, Vec::<String>::new(), "no schema, no migration left");

    startup::migrate(&pool).await.unwrap();
    let secrets: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox.scope_secret")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(secrets, 1);
}
