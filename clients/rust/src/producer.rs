//! The producer: `Outbox::enqueue` records intents that exist if and only if the caller's
//! open sqlx transaction commits (the two-phase token of docs/producers.md), and
//! `enqueue_direct` records them at once.

use std::collections::HashMap;
#[cfg(feature = "sqlx")]
use std::sync::OnceLock;
use std::time::{Duration, SystemTime};

use crate::connection::{CallOptions, Connection, Retry};
use crate::error::Error;
use crate::proto::{self, IntentState};

/// The token in plain SQL, for databases of the cluster other than the outbox's
/// (docs/producers.md). The logical-decoding message makes the transaction write WAL, so
/// its COMMIT is flushed (and replicated to a synchronous standby) even if it wrote
/// nothing else.
pub const PLAIN_TOKEN_SQL: &str = "SELECT 'v2.' || system_identifier || '.' || \
    (extract(epoch FROM least(pg_stat_get_bgwriter_stat_reset_time(), \
    (SELECT stats_reset FROM pg_stat_archiver))) * 1000000)::bigint \
    || '.' || pg_current_xact_id() \
    FROM pg_control_system(), pg_logical_emit_message(true, 'outboxd', '')";

/// The token from the outbox schema's function: promoted the moment the transaction
/// commits (it sends a transactional NOTIFY).
pub const FUNCTION_TOKEN_SQL: &str = "SELECT outbox.txn_token()";

/// Whether the connection's database holds the outbox schema's token function.
#[cfg(feature = "sqlx")]
const DETECT_SQL: &str = "SELECT to_regprocedure('outbox.txn_token()') IS NOT NULL";

/// Where [`Outbox::enqueue`] takes the token.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TokenSource {
    /// `outbox.txn_token()` when the database holds the outbox schema, else the plain SQL.
    /// Probed once per [`Outbox`]: use one `Outbox` per database.
    #[default]
    Auto,
    /// Always `outbox.txn_token()` ([`FUNCTION_TOKEN_SQL`]): the outbox's own database.
    /// Promoted at commit.
    Function,
    /// Always the plain SQL ([`PLAIN_TOKEN_SQL`]): any database of the outbox's cluster.
    /// Promoted by outboxd's sweep (~100 ms), without the function's NOTIFY, whose
    /// commits PostgreSQL serializes.
    Plain,
}

/// One intent to enqueue.
///
/// ```
/// use std::time::Duration;
/// use outboxd_client::NewIntent;
/// let intent = NewIntent::new("email.send", br#"{"to":"ada@example.com"}"#.to_vec())
///     .content_type("application/json")
///     .idempotency_key("orders/7/welcome-email")
///     .ordering_key("customers/42")
///     .priority(5)
///     .header("x-order", "7")
///     .delay(Duration::from_secs(60));
/// ```
#[derive(Clone, Debug)]
pub struct NewIntent {
    message: proto::NewIntent,
}

impl NewIntent {
    /// An intent of `kind` (the routing key workers claim by) carrying `payload` as is.
    pub fn new(kind: impl Into<String>, payload: impl Into<Vec<u8>>) -> Self {
        Self {
            message: proto::NewIntent {
                kind: kind.into(),
                payload: payload.into(),
                ..proto::NewIntent::default()
            },
        }
    }

    /// The payload's media type, e.g. `application/json`.
    pub fn content_type(mut self, content_type: impl Into<String>) -> Self {
        self.message.content_type = content_type.into();
        self
    }

    /// Only workers of this region (or of none) may claim it.
    pub fn region(mut self, region: impl Into<String>) -> Self {
        self.message.region = region.into();
        self
    }

    /// Per-tenant deduplication key: enqueuing it again returns the existing intent
    /// (`deduplicated`). With keys on every intent of a call, a call whose answer was
    /// lost is retried safely.
    pub fn idempotency_key(mut self, key: impl Into<String>) -> Self {
        self.message.idempotency_key = key.into();
        self
    }

    /// Delivered one at a time with the other intents of this key (per tenant), in the
    /// order their transactions committed (within one call, request order): a later one
    /// is [`IntentState::Waiting`] until the earlier ones finish. Empty: unordered. Needs
    /// the database's `track_commit_timestamp` (else `FAILED_PRECONDITION`,
    /// `ORDERING_UNAVAILABLE`).
    pub fn ordering_key(mut self, key: impl Into<String>) -> Self {
        self.message.ordering_key = key.into();
        self
    }

    /// From -10 to 10 (default 0): among the claimable intents of its tenant and kind,
    /// higher priorities are claimed first, equal ones oldest first. Outside the range the
    /// call fails with `INVALID_ARGUMENT`.
    pub fn priority(mut self, priority: i32) -> Self {
        self.message.priority = priority;
        self
    }

    /// A header carried to the worker.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.message.headers.insert(name.into(), value.into());
        self
    }

    /// Headers carried to the worker (added to those already set).
    pub fn headers(mut self, headers: HashMap<String, String>) -> Self {
        self.message.headers.extend(headers);
        self
    }

    /// Claims allowed before it is dead-lettered (default: the server's, 5).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.message.max_attempts = i32::try_from(attempts).unwrap_or(i32::MAX);
        self
    }

    /// Claimable this long after the call.
    pub fn delay(mut self, delay: Duration) -> Self {
        self.message.schedule = Some(proto::new_intent::Schedule::Delay(crate::proto_duration(
            delay,
        )));
        self
    }

    /// Claimable from this instant on.
    pub fn available_at(mut self, at: SystemTime) -> Self {
        self.message.schedule = Some(proto::new_intent::Schedule::AvailableAt(at.into()));
        self
    }

    /// The wire message.
    pub fn into_proto(self) -> proto::NewIntent {
        self.message
    }
}

impl From<proto::NewIntent> for NewIntent {
    fn from(message: proto::NewIntent) -> Self {
        Self { message }
    }
}

/// One enqueued intent, in request order.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct EnqueueResult {
    /// The intent's id (the existing one's when deduplicated).
    pub id: String,
    /// `Staged` in a transaction, `Pending` when direct (`Waiting` behind an unfinished
    /// intent of its ordering key); the current state when deduplicated.
    pub state: IntentState,
    /// The idempotency key matched an intent already recorded.
    pub deduplicated: bool,
}

/// A producer's handle on outboxd: enqueues in the caller's transaction, or directly.
/// Cheap to clone; clones share what it learnt of its database (whether it has
/// `outbox.txn_token()`), so make one with [`Outbox::new`] per database.
///
/// ```no_run
/// # async fn f(pool: sqlx::PgPool, connection: outboxd_client::Connection) -> Result<(), outboxd_client::Error> {
/// use outboxd_client::{NewIntent, Outbox};
/// let outbox = Outbox::new(connection);
/// let mut tx = pool.begin().await?;
/// let order_id: i64 = sqlx::query_scalar("INSERT INTO orders (total) VALUES (1999) RETURNING id")
///     .fetch_one(&mut *tx)
///     .await?;
/// outbox
///     .enqueue(&mut tx, NewIntent::new("order.created", order_id.to_string())
///         .idempotency_key(format!("orders/{order_id}/created")))
///     .await?; // STAGED: invisible to workers until the commit
/// tx.commit().await?; // PENDING now; a rollback would have DISCARDED it
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct Outbox {
    connection: Connection,
    token: TokenSource,
    timeout: Duration,
    #[cfg(feature = "sqlx")]
    has_function: std::sync::Arc<OnceLock<bool>>,
}

impl Outbox {
    /// A producer over `connection`: [`TokenSource::Auto`], each call bounded by the
    /// connection's call timeout.
    pub fn new(connection: Connection) -> Self {
        let timeout = connection.call_timeout();
        Self {
            connection,
            token: TokenSource::Auto,
            timeout,
            #[cfg(feature = "sqlx")]
            has_function: Default::default(),
        }
    }

    /// Where the token is taken (default [`TokenSource::Auto`]).
    pub fn token_source(mut self, token: TokenSource) -> Self {
        self.token = token;
        self
    }

    /// Bounds each enqueue, retries included (default: the connection's call timeout), so
    /// a transaction is never held open on a stuck call.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The connection, for other calls ([`Connection::get_intent`], [`Connection::call`]).
    pub fn connection(&self) -> &Connection {
        &self.connection
    }

    /// Enqueues one intent in the open transaction `tx`: `STAGED` now, `PENDING` when
    /// `tx` commits, `DISCARDED` if it rolls back.
    ///
    /// # Errors
    /// [`Error::Savepoint`] when `tx` is a nested transaction; [`Error::Database`] when the
    /// token query fails (a failed transaction: roll it back); [`Error::Status`] when
    /// outboxd refuses (`TXN_ABORTED`, `IDEMPOTENCY_CONFLICT`, …) or does not answer.
    #[cfg(feature = "sqlx")]
    pub async fn enqueue(
        &self,
        tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
        intent: NewIntent,
    ) -> Result<EnqueueResult, Error> {
        let results = self.enqueue_many(tx, [intent]).await?;
        one_result(results)
    }

    /// Enqueues a batch (all or none, at most the server's batch limit, 1,000 by default)
    /// in the open transaction `tx`.
    ///
    /// # Errors
    /// As [`Outbox::enqueue`]; [`Error::Invalid`] for an empty batch.
    #[cfg(feature = "sqlx")]
    pub async fn enqueue_many(
        &self,
        tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
        intents: impl IntoIterator<Item = NewIntent>,
    ) -> Result<Vec<EnqueueResult>, Error> {
        let intents = messages(intents)?;
        let token = self.txn_token(tx).await?;
        self.send(intents, token).await
    }

    /// The two-phase token naming the open transaction `tx`, for
    /// [`Outbox::enqueue_with_token`].
    ///
    /// # Errors
    /// As [`Outbox::enqueue`], before anything is sent to outboxd.
    #[cfg(feature = "sqlx")]
    pub async fn txn_token(
        &self,
        tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    ) -> Result<String, Error> {
        use sqlx::TransactionManager;
        // A token names the top-level transaction: a ROLLBACK TO SAVEPOINT would leave
        // intents of rows that no longer exist.
        if sqlx::postgres::PgTransactionManager::get_transaction_depth(tx) > 1 {
            return Err(Error::Savepoint);
        }
        let function = match self.token {
            TokenSource::Function => true,
            TokenSource::Plain => false,
            TokenSource::Auto => match self.has_function.get() {
                Some(known) => *known,
                None => {
                    let found: bool = sqlx::query_scalar(DETECT_SQL).fetch_one(&mut **tx).await?;
                    *self.has_function.get_or_init(|| found)
                }
            },
        };
        let sql = if function {
            FUNCTION_TOKEN_SQL
        } else {
            PLAIN_TOKEN_SQL
        };
        let token: Option<String> = sqlx::query_scalar(sql).fetch_one(&mut **tx).await?;
        match token {
            Some(token) if !token.is_empty() => Ok(token),
            // Empty would mean direct mode: intents of a transaction that may roll back.
            _ => Err(Error::Invalid(
                "outboxd: the token query returned nothing".into(),
            )),
        }
    }

    /// Enqueues with a token you took yourself, in the transaction it names (another
    /// driver: `SELECT outbox.txn_token()` or [`PLAIN_TOKEN_SQL`]). Call it before that
    /// transaction commits.
    ///
    /// # Errors
    /// [`Error::Invalid`] for an empty token or batch; outboxd's refusal.
    pub async fn enqueue_with_token(
        &self,
        token: &str,
        intents: impl IntoIterator<Item = NewIntent>,
    ) -> Result<Vec<EnqueueResult>, Error> {
        if token.is_empty() {
            return Err(Error::Invalid(
                "outboxd: an empty token means direct mode; use enqueue_direct for that".into(),
            ));
        }
        self.send(messages(intents)?, token.to_owned()).await
    }

    /// Enqueues one intent outside any transaction: `PENDING` as soon as this returns.
    ///
    /// # Errors
    /// outboxd's refusal, or no answer within the timeout.
    pub async fn enqueue_direct(&self, intent: NewIntent) -> Result<EnqueueResult, Error> {
        let results = self.enqueue_direct_many([intent]).await?;
        one_result(results)
    }

    /// Enqueues a batch (all or none) outside any transaction.
    ///
    /// # Errors
    /// [`Error::Invalid`] for an empty batch; outboxd's refusal, or no answer.
    pub async fn enqueue_direct_many(
        &self,
        intents: impl IntoIterator<Item = NewIntent>,
    ) -> Result<Vec<EnqueueResult>, Error> {
        self.send(messages(intents)?, String::new()).await
    }

    async fn send(
        &self,
        intents: Vec<proto::NewIntent>,
        txn_token: String,
    ) -> Result<Vec<EnqueueResult>, Error> {
        // A lost answer may have recorded the intents: a retry is safe only when every
        // intent has an idempotency key (the replay returns them); otherwise only when
        // the server cannot have recorded anything.
        let keyed = intents.iter().all(|i| !i.idempotency_key.is_empty());
        let retry = if keyed {
            Retry::Transient
        } else {
            Retry::IfNotApplied
        };
        // A retryable call's first try leaves half its time for the next endpoint.
        let first_try = if keyed {
            self.timeout / 2
        } else {
            self.timeout
        };
        let options = CallOptions::new(first_try)
            .budget(self.timeout)
            .bounded()
            .retry(retry);
        let request = proto::EnqueueRequest { intents, txn_token };
        let answer = self
            .connection
            .call(options, |mut client| {
                let request = request.clone();
                async move { client.enqueue(request).await }
            })
            .await?;
        Ok(answer
            .results
            .into_iter()
            .map(|r| EnqueueResult {
                state: IntentState::try_from(r.state).unwrap_or(IntentState::Unspecified),
                id: r.id,
                deduplicated: r.deduplicated,
            })
            .collect())
    }
}

fn messages(intents: impl IntoIterator<Item = NewIntent>) -> Result<Vec<proto::NewIntent>, Error> {
    let mut messages: Vec<_> = intents.into_iter().map(NewIntent::into_proto).collect();
    // The producer's span is each intent's creation context, unless it names its own.
    let context = crate::trace::current_context();
    if !context.is_empty() {
        for message in messages
            .iter_mut()
            .filter(|m| !m.headers.contains_key("traceparent"))
        {
            message.headers.extend(context.clone());
        }
    }
    if messages.is_empty() {
        return Err(Error::Invalid("outboxd: nothing to enqueue".into()));
    }
    Ok(messages)
}

/// The result of a one-intent call: an answer without it is the server's fault, said as
/// such (the intent may exist).
fn one_result(results: Vec<EnqueueResult>) -> Result<EnqueueResult, Error> {
    results.into_iter().next().ok_or_else(|| {
        Error::Status(Box::new(tonic::Status::internal(
            "outboxd answered an Enqueue of one intent without its result",
        )))
    })
}
