//! Enqueue, direct or joined to a producer's transaction through the two-phase token: the
//! rules of docs/design.md ("The two-phase token") applied before anything is written.

use std::collections::HashSet;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;

use super::claim::handoff::{Handoffs, Release};
use super::claim::tally::ClaimTally;
use super::group_commit::GroupCommit;
use super::store::{self, AlsoAtBegin, EnqueueParams, Pools, TenantScope, TxnStatus};
use super::token::TxnToken;
use super::{Enqueued, Error, FieldViolation, NewIntent, Result};

/// Most intents one shared direct-mode transaction takes (the default Enqueue batch limit).
const MAX_GROUPED_INTENTS: usize = 1000;

/// Direct-mode calls with more intents than this run in a transaction of their own, at
/// once: their commit is already shared by many intents, and making them wait for another
/// call's transaction would only serialise a tenant's large batches.
const MAX_GROUPED_CALL: usize = 100;

/// Calls grouped by tenant and test clock; each call is its intents, answered with theirs.
type Groups = GroupCommit<(String, Option<DateTime<Utc>>), Vec<NewIntent>, Vec<Enqueued>, Error>;

/// Direct-mode Enqueue calls of one tenant (and one test clock) that arrive while another
/// is committing share the next transaction: one commit, one WAL flush for all of them.
/// Two-phase calls never share one: each checks its own producer transaction.
#[derive(Debug)]
pub struct DirectEnqueues {
    groups: Groups,
    inserts: DirectInserts,
}

/// What every direct-mode transaction shares.
#[derive(Debug, Clone)]
struct DirectInserts {
    transactions: Counter,
    handoffs: Arc<Handoffs>,
    tally: Option<Arc<ClaimTally>>,
}

/// What direct enqueues count: calls waiting for a shared transaction, and transactions.
#[derive(Debug, Clone, Default)]
pub struct EnqueueCounters {
    pub calls_waiting: Gauge,
    pub transactions: Counter,
}

impl DirectEnqueues {
    /// Counting into `counters`, and the leases handed to waiting claims into `tally`;
    /// leases that no claimer received go to `release` (`super::claim::handoff`).
    pub fn new(
        counters: EnqueueCounters,
        release: Release,
        tally: Option<Arc<ClaimTally>>,
    ) -> Self {
        Self {
            groups: GroupCommit::new(
                fits_shared_transaction,
                commit_outcome_unknown,
                counters.calls_waiting,
            ),
            inserts: DirectInserts {
                transactions: counters.transactions,
                handoffs: Arc::new(Handoffs::new(release)),
                tally,
            },
        }
    }

    /// The Claim calls of this server waiting for what direct enqueues insert.
    pub fn handoffs(&self) -> &Arc<Handoffs> {
        &self.inserts.handoffs
    }
}

/// A call joins a shared transaction while the intents stay within one Enqueue's limit and
/// share no idempotency key with the calls already in it: keys are unique within one
/// insert, and two calls racing on a key are answered as if they ran one after the other.
#[allow(
    clippy::ptr_arg,
    reason = "the shape GroupCommit asks of `fits`, with calls as Vec"
)]
fn fits_shared_transaction(batch: &[Arc<Vec<NewIntent>>], call: &Vec<NewIntent>) -> bool {
    let count: usize = batch.iter().map(|c| c.len()).sum();
    if count + call.len() > MAX_GROUPED_INTENTS {
        return false;
    }
    let keys: HashSet<&str> = batch
        .iter()
        .flat_map(|c| c.iter())
        .filter_map(|i| i.idempotency_key.as_deref())
        .collect();
    call.iter()
        .filter_map(|i| i.idempotency_key.as_deref())
        .all(|k| !keys.contains(k))
}

/// A shared transaction whose COMMIT lost its answer, or whose task panicked, may have
/// recorded its calls' intents: running them again alone would record those without
/// idempotency keys twice, so each call is answered that its outcome is unknown, as a call
/// alone would be (never "nothing written", which clients retry).
fn commit_outcome_unknown(e: &Error) -> Option<Error> {
    matches!(
        e,
        Error::CommitOutcomeUnknown | Error::Database(sqlx::Error::WorkerCrashed)
    )
    .then_some(Error::CommitOutcomeUnknown)
}

/// A transaction for `tenant_id`'s enqueue: its statements are planned once per
/// connection (see `AlsoAtBegin::GenericPlans`) and register their levels themselves.
async fn begin_enqueue(
    pools: &Pools,
    tenant_id: &str,
) -> Result<sqlx::Transaction<'static, sqlx::Postgres>> {
    let scope = TenantScope::one(tenant_id);
    store::begin_with(
        pools,
        &scope,
        &[
            AlsoAtBegin::IndexPlans,
            AlsoAtBegin::GenericPlans,
            AlsoAtBegin::LevelsRegistered,
        ],
    )
    .await
}

/// Inserts the intents of several direct-mode calls in one transaction, counted once
/// committed, leasing what it can to the claimers waiting in `direct.handoffs`; the
/// results of each call, in order.
async fn insert_direct(
    pools: &Pools,
    direct: &DirectInserts,
    tenant_id: &str,
    calls: &[Arc<Vec<NewIntent>>],
    now: Option<DateTime<Utc>>,
) -> Result<Vec<Vec<Enqueued>>> {
    let mut tx = begin_enqueue(pools, tenant_id).await?;
    let flat;
    let intents: &[NewIntent] = match calls {
        [one] => one,
        _ => {
            flat = calls
                .iter()
                .flat_map(|c| c.iter().cloned())
                .collect::<Vec<_>>();
            &flat
        }
    };
    // Taken once the transaction has begun: a claimer waits for this enqueue's outcome
    // from now on, which should not include the wait for a connection.
    let taken = direct.handoffs.take(tenant_id, intents);
    let leases: Vec<_> = taken.iter().flat_map(|t| t.leases()).collect();
    let inserted = store::insert_intents(
        &mut tx,
        EnqueueParams {
            tenant_id,
            intents,
            txn_xid: None,
            now,
            leases: &leases,
        },
    )
    .await?;
    if let Err(e) = commit(tx).await {
        // The COMMIT may have happened, its answer lost: nobody has what it leased, and
        // its calls must not run again (`commit_outcome_unknown`).
        direct
            .handoffs
            .release(&TenantScope::one(tenant_id), inserted.leased);
        return Err(e);
    }
    direct.transactions.inc();
    if let Some(taken) = taken {
        if let Some(tally) = &direct.tally {
            tally.count(&inserted.leased);
        }
        let ids: Vec<_> = inserted.enqueued.iter().map(|e| e.id).collect();
        taken.hand_over(&ids, inserted.leased);
    }
    let mut results = inserted.enqueued.into_iter();
    Ok(calls
        .iter()
        .map(|c| results.by_ref().take(c.len()).collect())
        .collect())
}

/// Records `intents` for `tenant_id` (in a transaction scoped to it): PENDING at once
/// without a token (in a transaction it may share with other direct calls of the tenant,
/// see [`DirectEnqueues`]); STAGED until the producer's transaction finishes with one.
/// Returns only after outboxd's own commit.
///
/// # Errors
/// - [`Error::InvalidArgument`]: the token names another cluster or a transaction that
///   does not exist;
/// - [`Error::TxnAborted`]: the producer's transaction already rolled back, or the server
///   crashed (or was restored) since the token was taken, which ended that transaction;
/// - [`Error::TxnFinished`]: it already committed, and this is not a replay of an enqueue
///   recorded before the commit (same idempotency keys and content);
/// - [`Error::CommitOutcomeUnknown`]: the COMMIT lost its answer (the intents may exist);
/// - [`Error::IdempotencyConflict`], [`Error::Database`].
pub async fn enqueue(
    pools: &Pools,
    direct: &DirectEnqueues,
    cluster_id: &str,
    tenant_id: &str,
    intents: Vec<NewIntent>,
    token: Option<TxnToken>,
    now: Option<DateTime<Utc>>,
) -> Result<Vec<Enqueued>> {
    let Some(token) = token else {
        // Ordered intents are not grouped: their transaction holds their keys' locks until
        // it commits (`store::insert_intents`), which a shared one would hold for all.
        if intents.len() > MAX_GROUPED_CALL || intents.iter().any(|i| i.ordering_key.is_some()) {
            // In a task of its own, as a shared transaction is: a call cancelled while it
            // commits must not take with it the answer to the claims it handed intents to
            // (`super::claim::handoff`).
            let (pools, inserts, tenant) =
                (pools.clone(), direct.inserts.clone(), tenant_id.to_owned());
            let calls = [Arc::new(intents)];
            let results =
                tokio::spawn(
                    async move { insert_direct(&pools, &inserts, &tenant, &calls, now).await },
                )
                .await
                // A panic in it may have come after its commit.
                .unwrap_or(Err(Error::CommitOutcomeUnknown))?;
            return Ok(results.into_iter().next().unwrap_or_default());
        }
        let (pools, tenant) = (pools.clone(), tenant_id.to_owned());
        let inserts = direct.inserts.clone();
        let run = move |calls: Vec<Arc<Vec<NewIntent>>>| {
            let (pools, tenant, inserts) = (pools.clone(), tenant.clone(), inserts.clone());
            async move { insert_direct(&pools, &inserts, &tenant, &calls, now).await }
        };
        return direct
            .groups
            .submit((tenant_id.to_owned(), now), intents, run)
            .await;
    };
    let mut tx = begin_enqueue(pools, tenant_id).await?;
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
        // A replay is answered even from an earlier server life: intents recorded with
        // the token were committed by an outboxd transaction whose id is higher than
        // the producer's, so crash recovery, which resumes handing out ids above every
        // id in the WAL, cannot have given the producer's id to anyone else. One still
        // open is a prepared transaction (two-phase commit) that outlived the crash: its
        // staged intents follow its COMMIT PREPARED. New intents are refused.
        TxnStatus::InProgress
        | TxnStatus::Prepared
        | TxnStatus::Committed
        | TxnStatus::Forgotten
            if !same_life =>
        {
            return replay(tx, token.xid, &intents, || stale_token(token.xid)).await;
        }
        TxnStatus::Future | TxnStatus::Aborted if !same_life => {
            return Err(stale_token(token.xid));
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
        // Its transaction manager may have voted on what it held: a replay only.
        TxnStatus::Prepared => {
            return replay(tx, token.xid, &intents, || {
                Error::TxnFinished(format!(
                    "the producer transaction {} is prepared (PREPARE TRANSACTION); enqueue \
                     must happen before PREPARE (only a replay with the same idempotency keys \
                     is accepted)",
                    token.xid
                ))
            })
            .await;
        }
        TxnStatus::Committed => {
            return replay(tx, token.xid, &intents, || {
                Error::TxnFinished(format!(
                    "the producer transaction {} already committed; enqueue must happen \
                     before COMMIT (only a replay with the same idempotency keys is accepted)",
                    token.xid
                ))
            })
            .await;
        }
    }
    let results = store::insert_intents(
        &mut tx,
        EnqueueParams {
            tenant_id,
            intents: &intents,
            txn_xid: Some(token.xid),
            now,
            leases: &[],
        },
    )
    .await?;
    commit(tx).await?;
    Ok(results.enqueued)
}

/// The answer to a retry of an Enqueue whose producer transaction is past staging
/// (committed, prepared, or of an earlier server life): the intents it recorded, `refused`
/// when it is no replay. Answered once the producer's commit is as durable as an answer of
/// ours: a WAL record of this transaction's own makes its COMMIT wait for the flush and a
/// synchronous standby, which come after the producer's commit record.
async fn replay(
    mut tx: sqlx::Transaction<'static, sqlx::Postgres>,
    xid: u64,
    intents: &[NewIntent],
    refused: impl FnOnce() -> Error,
) -> Result<Vec<Enqueued>> {
    let Some(found) = store::find_replay(&mut tx, xid, intents).await? else {
        return Err(refused());
    };
    store::commit_waits_for_flush(&mut tx).await?;
    commit(tx).await?;
    Ok(found)
}

/// Commits an enqueue's transaction. A COMMIT that failed may have happened (the
/// connection lost before its answer): the caller is told its outcome is unknown, and the
/// cause goes to the log.
async fn commit(tx: sqlx::Transaction<'static, sqlx::Postgres>) -> Result<()> {
    tx.commit().await.map_err(|e| {
        tracing::error!(
            error.cause_chain = ?e,
            error.message = %e,
            "the COMMIT of an enqueue failed; its intents may have been recorded"
        );
        Error::CommitOutcomeUnknown
    })
}

/// The answer to a token of an earlier server life that is not a replay: whatever its
/// transaction id reads now (open, committed, aborted), it may be a stranger's, handed
/// out again after the crash, a restore or a failover; the token's own transaction ended
/// with that server life without committing anything outboxd recorded.
fn stale_token(xid: u64) -> Error {
    Error::TxnAborted(format!(
        "the token names an earlier life of the cluster than the current one: PostgreSQL \
         recovered from a crash (or a restore, or a standby was promoted) after it was \
         taken, which ended the producer transaction {xid} (transaction ids are handed out \
         again after a crash, so this id may now name another), or an operator reset both \
         the bgwriter and archiver statistics (pg_stat_reset_shared), which the incarnation \
         is read from; either way no intent is staged on it: redo the transaction with a \
         new token"
    ))
}

fn bad_token(description: String) -> Error {
    Error::InvalidArgument(vec![FieldViolation::new("txn_token", description)])
}
