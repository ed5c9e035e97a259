-- The outbox's functions (baseline of 0.1.0): the two-phase token, and the hot-path
-- statements as PL/pgSQL functions. The scope and grant functions are in
-- …03_baseline_tenancy.
--
-- One round trip each. Claim, its long-poll next_due_in, Ack, Fail, ExtendLease and
-- MarkSubmitted each run as one statement in its own implicit transaction: one round trip
-- to PostgreSQL instead of three (BEGIN with the tenant scope, the statement, COMMIT). At
-- a steady 1000 intents/s round trips, not the statements, were most of PostgreSQL's CPU.
-- The reply still comes only after the commit: PostgreSQL answers the Sync that ends the
-- call once the implicit transaction has committed.
--
-- Each takes the caller's tenants and their proof first (`tenants`, `scope_proof`; the
-- fleet's scope passes '' for both), scopes its transaction with them as outboxd's BEGIN
-- does (outbox.enter_scope), and runs as its caller (SECURITY INVOKER), so row-level
-- security applies to it as to any statement.
-- Plan settings are the function's SET clauses: in force while it plans and runs,
-- restored after.
--
-- Cached plans. These functions are planned once per connection (plan_cache_mode =
-- force_generic_plan, index scans only): planning per call cost more than running (Ack:
-- 0.56 of 0.74 ms). A cached plan is made on whatever table the connection first sees, so
-- every lookup has an index condition that holds for any statistics (`i.id = ANY (ids)`):
-- a plan made on a tiny table (a new deployment) otherwise joined the batch to a full scan
-- of the primary key, and kept doing so after the table grew.
--
-- Row-level security. The policies' conditions are evaluated before any condition of the
-- query that PostgreSQL cannot prove leakproof, and such a condition cannot bound an index
-- scan. `coalesce(…)` is never proved leakproof, so a bound written
-- `available_at <= coalesce(as_of, now())` filters rows instead of ending the scan (a claim
-- that found fewer than its batch walked the whole claimable index). Time bounds are
-- therefore computed into PL/pgSQL variables first, which reach the planner as parameters.

-- Two-phase tokens. The token is v2.<system identifier>.<server incarnation>.<transaction
-- id>. PostgreSQL does not WAL-log handing out a transaction id: a transaction that took
-- its token but wrote nothing that reached disk before a crash leaves no trace, and crash
-- recovery hands the same id to the next transaction that asks (so does a restore to a
-- point in time, or a standby promoted after a failover). The incarnation tells the server
-- lives apart: outboxd compares it with its own and never stages intents on a token from
-- an earlier life.
--
-- The incarnation is when the cluster's shared statistics were last reset, in microseconds
-- since 1970: PostgreSQL discards them after every crash recovery (also a crash of one
-- backend, which restarts all of them but not the postmaster, so the postmaster's start
-- time would not do) and on restore, and keeps them across clean restarts. LEAST over two
-- kinds: an operator resetting one kind alone (pg_stat_reset_shared('bgwriter')) leaves it
-- unchanged. Producers in other databases of the cluster inline the same expression
-- (docs/producers.md).
CREATE FUNCTION outbox.server_incarnation() RETURNS bigint
LANGUAGE sql
STABLE
AS $$
    SELECT (extract(epoch FROM least(pg_stat_get_bgwriter_stat_reset_time(),
                                     (SELECT stats_reset FROM pg_stat_archiver)))
            * 1000000)::bigint
$$;

COMMENT ON FUNCTION outbox.server_incarnation() IS
    'Changes whenever PostgreSQL recovers from a crash or a restore: the lifetime a two-phase token belongs to';

-- Phase 1 of the two-phase token: called inside the producer's open transaction, it names
-- the cluster, its incarnation and the transaction. pg_current_xact_id() assigns the
-- transaction an id if it had none, so the token always names a real transaction.
--
-- The logical-decoding message makes the transaction write WAL, so that its COMMIT is
-- flushed (and waits for a synchronous standby) like any other: PostgreSQL does both only
-- for a transaction that wrote WAL of its own, and neither pg_current_xact_id() nor the
-- NOTIFY does. A producer transaction that wrote nothing but its token was acknowledged
-- before it was durable, and after a crash or a failover its id read "aborted". The
-- message is the smallest WAL record a transaction can write without a table: part of the
-- transaction (decoders see it only if it commits), no privilege needed, any wal_level;
-- its prefix 'outboxd' lets a logical-decoding consumer (Debezium and the like) ignore it.
--
-- The NOTIFY is transactional: PostgreSQL delivers it only if the producer commits, which
-- is exactly when outboxd should promote the staged intents at once instead of waiting
-- for its polling sweep.
CREATE FUNCTION outbox.txn_token() RETURNS text
LANGUAGE plpgsql
VOLATILE
AS $$
DECLARE
    token text;
BEGIN
    SELECT 'v2.' || system_identifier || '.' || outbox.server_incarnation() || '.'
           || pg_current_xact_id()
    INTO token
    FROM pg_control_system();
    PERFORM pg_logical_emit_message(true, 'outboxd', '');
    PERFORM pg_notify('outbox_txn_committed', '');
    RETURN token;
END;
$$;

COMMENT ON FUNCTION outbox.txn_token() IS
    'Two-phase token naming the current transaction, for outboxd Enqueue(txn_token)';

-- pg_xact_status, but 'future' for an id not handed out yet instead of an error (which
-- would abort outboxd's transaction: it checks the token in the transaction that stages
-- the intents) and 'forgotten' for one too old to look up.
CREATE FUNCTION outbox.xact_status(xid xid8) RETURNS text
LANGUAGE plpgsql
STABLE
AS $$
BEGIN
    RETURN coalesce(pg_xact_status(xid), 'forgotten');
EXCEPTION WHEN invalid_parameter_value THEN
    RETURN 'future';
END;
$$;

-- What an intent adds to a reply, near enough: its large parts (payload, headers, last
-- error) and 512 bytes for the rest, bounded by the name limits. A Claim and a ListIntents
-- page stop at a byte budget inside the statement, so that the rows they will not send are
-- never read (a Claim of 1000 intents of 1 MiB read 1 GB to send 3). octet_length of a
-- bytea or text reads the stored size (the TOAST pointer's for a large value), never the
-- value; pg_column_size of the headers is their stored, maybe compressed, size. The
-- server's in-memory reply budget (`split_at_reply_budget`) stays the exact guard.
CREATE FUNCTION outbox.reply_weight(payload bytea, headers jsonb, last_error text)
RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
RETURN 512 + coalesce(octet_length(payload), 0) + coalesce(pg_column_size(headers), 0)
    + coalesce(octet_length(last_error), 0);

-- Leases up to `max_intents` claimable intents, oldest available_at first, of the
-- worker's region (or none) and `kinds` (empty: any); see src/outbox/store/claim.rs for
-- the arguments. With a `request_id` that already leased intents for this worker, returns
-- those live leases (within the same filters: a region-bound key must not get another
-- region's leases by naming another worker's request) instead of leasing more; retries of
-- one request id are serialised by an advisory lock held to the end of the transaction.
--
-- `look_back_to` is a floor: only intents available at or after it are leased (NULL: the
-- whole queue). The claimable index keeps an entry for every version of a row that was
-- PENDING until vacuum removes it, and while a session pins the xmin horizon nothing is
-- removed: every claim walked the entries of all intents claimed since the pin began, and
-- claim time grew without bound. The server passes a floor a little behind the newest
-- intent a group of claimers took, and looks at the whole queue every few seconds
-- (src/outbox/claim/floor.rs says why a floor never loses an intent).
--
-- `max_bytes` is a budget (NULL: none): the oldest candidates are locked and taken while
-- the weight of those before each is under it, so at least one, however large. Rows past
-- the budget are locked for the statement but neither updated nor returned.
--
-- The shape keeps one plan good for every batch and table size (a backlog planned
-- otherwise got a bitmap scan and a sort of the whole backlog per claim, ~110 ms at 200k
-- pending):
-- - the rows to lease are picked in an ARRAY(…) subquery, not a CTE joined back: a join is
--   planned for a guessed LIMIT (a tenth of the table), and a merge join over the whole
--   primary key was the generic plan of that shape;
-- - they are found again by ctid, a direct tuple fetch instead of a primary-key lookup.
-- The transition is guarded by the subquery: FOR UPDATE locks only rows that are PENDING
-- (rechecked on the newest version of each), and nobody can change a locked row before
-- the UPDATE. A row whose locked version is newer than the statement's snapshot is not
-- visible at that ctid and is left alone. No state test is repeated on the outer UPDATE
-- on purpose: it would match the claimable index's predicate, and a generic plan made on
-- a small table walked that whole index per claim.
CREATE FUNCTION outbox.claim(
    tenants text,
    scope_proof text,
    worker text,
    worker_region text,
    kinds text[],
    max_intents int,
    lease_ms bigint,
    request_id text,
    as_of timestamptz,
    look_back_to timestamptz,
    max_bytes bigint
) RETURNS SETOF outbox.intent
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
DECLARE
    -- Bounds as variables, so that they bound the index scan (see the top of this file).
    claim_at timestamptz := coalesce(as_of, now());
    claim_from timestamptz := coalesce(look_back_to, '-infinity');
    budget bigint := greatest(coalesce(max_bytes, 9223372036854775807), 1);
BEGIN
    PERFORM outbox.enter_scope(tenants, scope_proof);
    IF request_id IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(hashtextextended(worker || '/' || request_id, 0));
        RETURN QUERY
            SELECT *
            FROM outbox.intent i
            WHERE i.worker_id = worker
              AND i.claim_request_id = request_id
              AND i.state IN ('leased', 'submitted')
              AND (worker_region = '' OR i.region = '' OR i.region = worker_region)
              AND (cardinality(kinds) = 0 OR i.kind = ANY (kinds));
        IF FOUND THEN
            RETURN;
        END IF;
    END IF;
    RETURN QUERY
        UPDATE outbox.intent i
        SET state = 'leased',
            attempts = i.attempts + 1,
            lease_id = gen_random_uuid(),
            lease_expires_at = claim_at + lease_ms * interval '1 ms',
            worker_id = worker,
            claim_request_id = request_id,
            updated_at = claim_at
        WHERE i.ctid = ANY (ARRAY(
                SELECT c.ctid
                FROM (
                    SELECT p.ctid, p.weight,
                           sum(p.weight) OVER (ORDER BY p.available_at, p.id
                                               ROWS UNBOUNDED PRECEDING) AS through
                    FROM (
                        SELECT p.ctid, p.available_at, p.id,
                               outbox.reply_weight(p.payload, p.headers, p.last_error) AS weight
                        FROM outbox.intent p
                        WHERE p.state = 'pending'
                          AND p.available_at <= claim_at
                          AND p.available_at >= claim_from
                          AND (worker_region = '' OR p.region = '' OR p.region = worker_region)
                          AND (cardinality(kinds) = 0 OR p.kind = ANY (kinds))
                        ORDER BY p.available_at, p.id
                        LIMIT max_intents
                        FOR UPDATE SKIP LOCKED
                    ) p
                ) c
                WHERE c.through - c.weight < budget
            ))
        RETURNING i.*;
END
$$;

-- Seconds until the next PENDING intent matching a claim's filters becomes due, if one is
-- scheduled in the future: a long-polling claimer that found nothing sleeps that long.
CREATE FUNCTION outbox.next_due_in(
    tenants text,
    scope_proof text,
    worker_region text,
    kinds text[],
    as_of timestamptz
) RETURNS float8
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
DECLARE
    look_at timestamptz := coalesce(as_of, now());
BEGIN
    PERFORM outbox.enter_scope(tenants, scope_proof);
    RETURN (
        SELECT extract(epoch FROM p.available_at - look_at)::float8
        FROM outbox.intent p
        WHERE p.state = 'pending'
          AND p.available_at > look_at
          AND (worker_region = '' OR p.region = '' OR p.region = worker_region)
          AND (cardinality(kinds) = 0 OR p.kind = ANY (kinds))
        ORDER BY p.available_at
        LIMIT 1
    );
END
$$;

-- The settles. Each takes `intent_ids[k]` under lease `lease_ids[k]` (and, for Fail, the
-- k-th of its other arrays), applies to the items whose lease is the intent's, and returns
-- the intents it changed as (id, state, lease_expires_at, traceparent); the caller matches
-- them to its items (src/outbox/store/settle.rs decodes them by position). They fence by
-- lease only: a region-bound key's settle first asks outbox.settleable_in_regions.
--
-- Each joins its batch (`unnest(intent_ids, lease_ids, …)`) to the intents by hash and
-- reads the intents by primary key (`i.id = ANY (intent_ids)`), nested loops and merge
-- joins off: with only nested loops the planner put the primary-key scan outside and the
-- batch inside and matched every intent against every item (an Ack of 1,000 spent 240 of
-- its 246 ms there); the hash join is linear (18 ms), on a tiny table as on a large one.

-- Marks the leased intents DELIVERED in place, from the live lease (LEASED, SUBMITTED,
-- even expired but not yet rescued) or from the last lease of a NEEDS_RECONCILE intent.
-- What the two Acks below leave to it: intents with an idempotency key (which stay where
-- the unique index on their key guards it), lost leases and replays.
CREATE FUNCTION outbox.ack(
    tenants text,
    scope_proof text,
    intent_ids uuid[],
    lease_ids uuid[],
    as_of timestamptz
) RETURNS TABLE (
    id uuid,
    state outbox.intent_state,
    lease_expires_at timestamptz,
    traceparent text
)
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = on
SET enable_mergejoin = off
SET enable_nestloop = off
AS $$
#variable_conflict use_column
BEGIN
    PERFORM outbox.enter_scope(tenants, scope_proof);
    RETURN QUERY
        UPDATE outbox.intent i
        SET state = 'delivered',
            lease_expires_at = NULL,
            claim_request_id = NULL,
            finished_at = coalesce(as_of, now()),
            updated_at = coalesce(as_of, now())
        FROM unnest(intent_ids, lease_ids) AS input(id, lease_id)
        WHERE i.id = ANY (intent_ids)
          AND i.id = input.id
          AND i.lease_id = input.lease_id
          AND i.state IN ('leased', 'submitted', 'needs_reconcile')
        RETURNING i.id, i.state, i.lease_expires_at, i.headers->>'traceparent';
END
$$;

-- Ack at a retention above zero: deletes each intent it delivers that has no idempotency
-- key from outbox.intent and stores it DELIVERED in outbox.delivered_batch, one row per
-- (tenant, region, bucket); the rest goes to outbox.ack.
CREATE FUNCTION outbox.ack_into_batches(
    tenants text,
    scope_proof text,
    intent_ids uuid[],
    lease_ids uuid[],
    as_of timestamptz
) RETURNS TABLE (
    id uuid,
    state outbox.intent_state,
    lease_expires_at timestamptz,
    traceparent text
)
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = on
SET enable_mergejoin = off
SET enable_nestloop = off
AS $$
#variable_conflict use_column
DECLARE
    delivered_at timestamptz := coalesce(as_of, now());
    moved bigint;
BEGIN
    PERFORM outbox.enter_scope(tenants, scope_proof);
    RETURN QUERY
        WITH delivered AS (
            DELETE FROM outbox.intent i
            USING unnest(intent_ids, lease_ids) AS input(id, lease_id)
            WHERE i.id = ANY (intent_ids)
              AND i.id = input.id
              AND i.lease_id = input.lease_id
              AND i.state IN ('leased', 'submitted', 'needs_reconcile')
              AND i.idempotency_key IS NULL
            RETURNING i.*
        ),
        stored AS (
            -- One Agg node feeds both arrays the same rows in the same order, so ids[k]
            -- is items[k]'s id.
            INSERT INTO outbox.delivered_batch (bucket, tenant_id, region, finished_at, ids, items)
            SELECT outbox.history_bucket(d.id), d.tenant_id, d.region, delivered_at,
                   array_agg(d.id),
                   array_agg(ROW(
                       d.id, d.tenant_id, d.kind, d.region, d.payload, d.content_type,
                       d.headers, NULL, 'delivered', d.attempts, d.max_attempts,
                       d.available_at, d.created_at, delivered_at, d.lease_id, NULL,
                       d.worker_id, NULL, d.last_error, delivered_at, d.txn_xid
                   )::outbox.delivered_intent_v1)
            FROM delivered d
            GROUP BY outbox.history_bucket(d.id), d.tenant_id, d.region
        )
        SELECT d.id, 'delivered'::outbox.intent_state, NULL::timestamptz,
               d.headers->>'traceparent'
        FROM delivered d;
    GET DIAGNOSTICS moved = ROW_COUNT;
    IF moved < cardinality(intent_ids) THEN
        -- What is left (keyed intents, lost leases, replays) is outbox.ack's: in place.
        RETURN QUERY
            SELECT * FROM outbox.ack(tenants, scope_proof, intent_ids, lease_ids, delivered_at);
    END IF;
END
$$;

-- Ack at retention zero: the purge would delete a delivered intent at its next run, so
-- the Ack deletes it instead (no new row version, no index entries for the purge to delete
-- again; the claim-and-ack ceiling rose from 27-31k to 43.5k intents/s). Only intents
-- without an idempotency key: a keyed one goes to outbox.ack, DELIVERED in place, where
-- the unique index still guards its key until the key's window
-- (OUTBOX_RETENTION__IDEMPOTENCY_KEYS) is over; with the row would go the key, and a
-- producer retrying an Enqueue whose answer it lost would record the intent twice.
CREATE FUNCTION outbox.ack_and_delete(
    tenants text,
    scope_proof text,
    intent_ids uuid[],
    lease_ids uuid[],
    as_of timestamptz
) RETURNS TABLE (
    id uuid,
    state outbox.intent_state,
    lease_expires_at timestamptz,
    traceparent text
)
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = on
SET enable_mergejoin = off
SET enable_nestloop = off
AS $$
#variable_conflict use_column
DECLARE
    deleted bigint;
BEGIN
    PERFORM outbox.enter_scope(tenants, scope_proof);
    RETURN QUERY
        DELETE FROM outbox.intent i
        USING unnest(intent_ids, lease_ids) AS input(id, lease_id)
        WHERE i.id = ANY (intent_ids)
          AND i.id = input.id
          AND i.lease_id = input.lease_id
          AND i.state IN ('leased', 'submitted', 'needs_reconcile')
          AND i.idempotency_key IS NULL
        RETURNING i.id, 'delivered'::outbox.intent_state, NULL::timestamptz,
                  i.headers->>'traceparent';
    GET DIAGNOSTICS deleted = ROW_COUNT;
    IF deleted < cardinality(intent_ids) THEN
        -- What is left (keyed intents, lost leases, replays) is outbox.ack's: in place.
        RETURN QUERY
            SELECT * FROM outbox.ack(tenants, scope_proof, intent_ids, lease_ids, as_of);
    END IF;
END
$$;

-- ExtendLease: pushes the expiry of live (LEASED or SUBMITTED) leases to
-- `as_of + lease_ms`. Its state test is written on the state as text, as MarkSubmitted's
-- is: as an enum test it implies the predicate of intent_lease_expires_at_idx, and a plan
-- made on a tiny table scanned that whole index (every live lease) instead of the primary
-- key.
CREATE FUNCTION outbox.extend_leases(
    tenants text,
    scope_proof text,
    intent_ids uuid[],
    lease_ids uuid[],
    lease_ms bigint,
    as_of timestamptz
) RETURNS TABLE (
    id uuid,
    state outbox.intent_state,
    lease_expires_at timestamptz,
    traceparent text
)
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = on
SET enable_mergejoin = off
SET enable_nestloop = off
AS $$
#variable_conflict use_column
BEGIN
    PERFORM outbox.enter_scope(tenants, scope_proof);
    RETURN QUERY
        UPDATE outbox.intent i
        SET lease_expires_at = coalesce(as_of, now()) + lease_ms * interval '1 ms',
            updated_at = coalesce(as_of, now())
        FROM unnest(intent_ids, lease_ids) AS input(id, lease_id)
        WHERE i.id = ANY (intent_ids)
          AND i.id = input.id
          AND i.lease_id = input.lease_id
          -- As text: see above on the lease-expiry index.
          AND i.state::text IN ('leased', 'submitted')
        RETURNING i.id, i.state, i.lease_expires_at, i.headers->>'traceparent';
END
$$;

-- MarkSubmitted: moves LEASED intents to SUBMITTED; from then on a lost outcome needs an
-- operator. A worker calls it before every non-idempotent side effect.
CREATE FUNCTION outbox.mark_submitted(
    tenants text,
    scope_proof text,
    intent_ids uuid[],
    lease_ids uuid[],
    as_of timestamptz
) RETURNS TABLE (
    id uuid,
    state outbox.intent_state,
    lease_expires_at timestamptz,
    traceparent text
)
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = on
SET enable_mergejoin = off
SET enable_nestloop = off
AS $$
#variable_conflict use_column
BEGIN
    PERFORM outbox.enter_scope(tenants, scope_proof);
    RETURN QUERY
        UPDATE outbox.intent i
        SET state = 'submitted',
            updated_at = coalesce(as_of, now())
        FROM unnest(intent_ids, lease_ids) AS input(id, lease_id)
        WHERE i.id = ANY (intent_ids)
          AND i.id = input.id
          AND i.lease_id = input.lease_id
          -- As text: see outbox.extend_leases.
          AND i.state::text = 'leased'
        RETURNING i.id, i.state, i.lease_expires_at, i.headers->>'traceparent';
END
$$;

-- Fail: item k failed with `outcomes[k]` ('retry', 'permanent' or 'unknown'), `errors[k]`
-- and, for a retry, `retry_after_ms[k]` (NULL: the backoff,
-- `least(cap_ms, base_ms * 2^(attempts - 1))` with jitter). RETRY → PENDING after it, or
-- DEAD_LETTERED when attempts are used up; PERMANENT → DEAD_LETTERED; UNKNOWN →
-- NEEDS_RECONCILE. Accepted from a live lease, and a definite outcome (RETRY, PERMANENT)
-- also from the last lease of a NEEDS_RECONCILE intent. A worker calls it for every intent
-- while its target is down.
CREATE FUNCTION outbox.fail(
    tenants text,
    scope_proof text,
    intent_ids uuid[],
    lease_ids uuid[],
    outcomes text[],
    errors text[],
    retry_after_ms bigint[],
    base_ms float8,
    cap_ms float8,
    as_of timestamptz
) RETURNS TABLE (
    id uuid,
    state outbox.intent_state,
    lease_expires_at timestamptz,
    traceparent text
)
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = on
SET enable_mergejoin = off
SET enable_nestloop = off
AS $$
#variable_conflict use_column
DECLARE
    -- A variable, not an expression in the query (see the top of this file).
    failed_at timestamptz := coalesce(as_of, now());
BEGIN
    PERFORM outbox.enter_scope(tenants, scope_proof);
    RETURN QUERY
        UPDATE outbox.intent i
        SET state = CASE
                WHEN input.outcome = 'unknown' THEN 'needs_reconcile'
                WHEN input.outcome = 'permanent' THEN 'dead_lettered'
                WHEN i.attempts >= i.max_attempts THEN 'dead_lettered'
                ELSE 'pending'
            END::outbox.intent_state,
            available_at = CASE
                WHEN input.outcome = 'retry' THEN failed_at
                    + coalesce(
                        input.retry_after_ms,
                        least(cap_ms, base_ms * power(2, least(greatest(i.attempts - 1, 0), 40)))
                            * (0.5 + random() / 2)
                    ) * interval '1 ms'
                ELSE i.available_at
            END,
            lease_expires_at = NULL,
            claim_request_id = NULL,
            last_error = input.error,
            updated_at = failed_at
        FROM unnest(intent_ids, lease_ids, outcomes, errors, retry_after_ms)
            AS input(id, lease_id, outcome, error, retry_after_ms)
        WHERE i.id = ANY (intent_ids)
          AND i.id = input.id
          AND i.lease_id = input.lease_id
          AND (i.state IN ('leased', 'submitted')
               OR (i.state = 'needs_reconcile' AND input.outcome <> 'unknown'))
        RETURNING i.id, i.state, i.lease_expires_at, i.headers->>'traceparent';
END
$$;

-- Which of `intent_ids` a key bound to `regions` may settle: intents of the caller's
-- tenants, in one of its regions or in none, live in outbox.intent (delivered ones cannot
-- be settled again; their replays are answered by the lookup that follows the settle,
-- filtered by region too). The server sends the others with a lease no intent carries, so
-- that they cannot apply and are answered NOT_FOUND, as another tenant's are: a key bound
-- to region eu holding the leaked lease of an intent of region us must not end its side
-- effect. A region never changes after Enqueue, so the answer cannot go stale before the
-- settle. One round trip more, only for keys with regions.
CREATE FUNCTION outbox.settleable_in_regions(
    tenants text,
    scope_proof text,
    intent_ids uuid[],
    regions text[]
) RETURNS SETOF uuid
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
BEGIN
    PERFORM outbox.enter_scope(tenants, scope_proof);
    RETURN QUERY
        SELECT i.id
        FROM outbox.intent i
        WHERE i.id = ANY (intent_ids)
          AND (i.region = '' OR i.region = ANY (regions));
END
$$;

-- The bucket of an intent id in outbox.delivered_batch: its first 48 bits (a UUIDv7's Unix
-- milliseconds) / 100. Any id has one, so a lookup never fails for a non-v7 id; it only
-- finds nothing.
CREATE FUNCTION outbox.history_bucket(id uuid) RETURNS bigint
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $$
    SELECT ('x' || encode(substring(uuid_send(id) FROM 1 FOR 6), 'hex'))::bit(48)::bigint / 100
$$;

-- The intents of `wanted_ids` the caller's tenants see, live or delivered. A plain SQL
-- function, so that PostgreSQL inlines it into the calling query and plans each part by
-- its index. The buckets are computed in a subquery, so that they bound the bucket index
-- scan under row-level security. In a bucket, a row is read only if its ids hold a wanted
-- one when few are wanted (GetIntent): that test compares every id with every wanted one,
-- so for a batch (a settle's replayed items) the rows of the bucket are read whole instead,
-- and their items matched through a hash of the wanted ids (a plain `= ANY` of a cached
-- plan's parameter is a linear search per item).
CREATE FUNCTION outbox.intents_by_id(wanted_ids uuid[]) RETURNS SETOF outbox.intent
LANGUAGE sql STABLE
AS $$
    SELECT * FROM outbox.intent i WHERE i.id = ANY (wanted_ids)
    UNION ALL
    SELECT x.*
    FROM outbox.delivered_batch b
    CROSS JOIN LATERAL unnest(b.items) x
    WHERE b.bucket = ANY ((
            SELECT array_agg(DISTINCT outbox.history_bucket(w)) FROM unnest(wanted_ids) w
          )::bigint[])
      AND (cardinality(wanted_ids) > 16 OR b.ids && wanted_ids)
      AND x.id IN (SELECT unnest(wanted_ids))
$$;
