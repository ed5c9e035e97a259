//! Enqueue, direct or joined to a producer's transaction through the two-phase token: the
//! rules of shared/DESIGN.md ("The two-phase token") applied before anything is written.

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use super::store::{self, AlsoAtBegin, EnqueueParams, TenantScope, TxnStatus};
use super::token::TxnToken;
use super::{Enqueued, Error, FieldViolation, NewIntent, Result};

/// Records `intents` for `tenant_id` (in a transaction scoped to it): PENDING at once
/// without a token; STAGED until the producer's transaction finishes with one. Returns
/// only after outboxd's own commit.
///
/// # Errors
/// - [`Error::InvalidArgument`]: the token names another cluster or a transaction that
///   does not exist;
/// - [`Error::TxnAborted`]: the producer's transaction already rolled back, or the server
///   crashed (or was restored) since the token was taken, which ended that transaction;
/// - [`Error::TxnFinished`]: it already committed, and this is not a replay of an enqueue
///   recorded before the commit (same idempotency keys and content);
/// - [`Error::IdempotencyConflict`], [`Error::Database`].
pub async fn enqueue(
    pool: &PgPool,
    cluster_id: &str,
    tenant_id: &str,
    intents: &[NewIntent],
    token: Option<TxnToken>,
    now: Option<DateTime<Utc>>,
) -> Result<Vec<Enqueued>> {
    let scope = TenantScope::one(tenant_id);
    let mut tx = store::begin_with(pool, &scope, &[AlsoAtBegin::GenericPlans]).await?;
    if let Some(token) = token {
        if token.system_identifier.to_string() != cluster_id {
            return Err(bad_token(format!(
                "names the PostgreSQL cluster {}, but outboxd stores intents in cluster \
                 {cluster_id}; the producer's transaction and the outbox must share one cluster",
                token.system_identifier
            )));
        }
        // Checked in the transaction that stages the intents (see store::check_token).
        let check = store::check_token(&mut tx, token.xid).await?;
        let same_life = check.incarnation == token.incarnation;
        match check.status {
            TxnStatus::InProgress | TxnStatus::Future | TxnStatus::Aborted if !same_life => {
                return Err(Error::TxnAborted(format!(
                    "PostgreSQL recovered from a crash (or a restore) after this token was \
                     taken, which ended the producer transaction {}; its intents must not \
                     exist (transaction ids are handed out again after a crash, so this id may \
                     now name another transaction)",
                    token.xid
                )));
            }
            TxnStatus::InProgress => {}
            TxnStatus::Future => {
                return Err(bad_token(format!(
                    "names transaction {}, which does not exist yet",
                    token.xid
                )));
            }
            TxnStatus::Aborted => {
                return Err(Error::TxnAborted(format!(
                    "the producer transaction {} already rolled back; its intents must not exist",
                    token.xid
                )));
            }
            TxnStatus::Forgotten => {
                return Err(Error::TxnFinished(format!(
                    "the producer transaction {} is too old to look up; enqueue inside an open transaction",
                    token.xid
                )));
            }
            // A commit is trusted even from an earlier server life: intents recorded with
            // the token were committed by an outboxd transaction whose id is higher than
            // the producer's, so crash recovery, which resumes handing out ids above every
            // id in the WAL, cannot have given the producer's id to anyone else.
            TxnStatus::Committed => {
                return store::find_replay(&mut tx, token.xid, intents)
                    .await?
                    .ok_or_else(|| {
                        Error::TxnFinished(format!(
                            "the producer transaction {} already committed; enqueue must happen \
                             before COMMIT (only a replay with the same idempotency keys is accepted)",
                            token.xid
                        ))
                    });
            }
        }
    }
    let results = store::insert_intents(
        &mut tx,
        EnqueueParams {
            tenant_id,
            intents,
            txn_xid: token.map(|t| t.xid),
            now,
        },
    )
    .await?;
    tx.commit().await?;
    Ok(results)
}

fn bad_token(description: String) -> Error {
    Error::InvalidArgument(vec![FieldViolation::new("txn_token", description)])
}
