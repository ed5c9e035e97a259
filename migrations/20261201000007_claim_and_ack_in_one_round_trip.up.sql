-- Claim and Ack, the two calls every delivered intent makes, each as one statement that
-- runs in its own implicit transaction: one round trip to PostgreSQL instead of three
-- (BEGIN with the tenant scope, the statement, COMMIT). At a steady 1000 intents/s round
-- trips, not the statements, were most of PostgreSQL's CPU (statements ~0.37 of its
-- 1.1 s per 1k intents). The reply still comes only after the commit: PostgreSQL answers
-- the Sync that ends the call once the implicit transaction has committed.
--
-- Each function scopes its transaction as outboxd's BEGIN does (outbox.tenants,
-- outbox.cross_tenant, transaction-local), and runs as its caller (SECURITY INVOKER), so
-- row-level security applies exactly as to the statements it replaces. Plan settings are
-- the function's SET clauses: in force while it plans and runs, restored after.

-- Scopes the current transaction to `tenants` (comma-separated) or, with
-- `cross_tenant` = 'on', to every tenant. PL/pgSQL, not SQL: a SQL function called from
-- PL/pgSQL is planned again on every call (53 µs a call, measured), a PL/pgSQL one once
-- per connection.
CREATE FUNCTION outbox.enter_scope(tenants text, cross_tenant text) RETURNS void
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    PERFORM set_config('outbox.tenants', tenants, true),
            set_config('outbox.cross_tenant', cross_tenant, true);
END
$$;

-- Leases up to `max_intents` claimable intents, oldest available_at first (see
-- src/outbox/store/claim.rs for the arguments). With a `request_id` that already leased
-- intents for this worker, returns those live leases instead of leasing more; retries of
-- one request id are serialised by an advisory lock held to the end of the transaction.
--
-- The shape keeps one plan good for every batch and table size, so it is planned once per
-- connection (generic plan, index scans only; a backlog planned otherwise got a bitmap
-- scan and a sort of the whole backlog per claim, ~110 ms at 200k pending):
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
    cross_tenant text,
    worker text,
    worker_region text,
    kinds text[],
    max_intents int,
    lease_ms bigint,
    request_id text,
    as_of timestamptz
) RETURNS SETOF outbox.intent
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
BEGIN
    PERFORM outbox.enter_scope(tenants, cross_tenant);
    IF request_id IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(hashtextextended(worker || '/' || request_id, 0));
        RETURN QUERY
            SELECT *
            FROM outbox.intent i
            WHERE i.worker_id = worker
              AND i.claim_request_id = request_id
              AND i.state IN ('leased', 'submitted');
        IF FOUND THEN
            RETURN;
        END IF;
    END IF;
    RETURN QUERY
        UPDATE outbox.intent i
        SET state = 'leased',
            attempts = i.attempts + 1,
            lease_id = gen_random_uuid(),
            lease_expires_at = coalesce(as_of, now()) + lease_ms * interval '1 ms',
            worker_id = worker,
            claim_request_id = request_id,
            updated_at = coalesce(as_of, now())
        WHERE i.ctid = ANY (ARRAY(
                SELECT p.ctid
                FROM outbox.intent p
                WHERE p.state = 'pending'
                  AND p.available_at <= coalesce(as_of, now())
                  AND (worker_region = '' OR p.region = '' OR p.region = worker_region)
                  AND (cardinality(kinds) = 0 OR p.kind = ANY (kinds))
                ORDER BY p.available_at, p.id
                LIMIT max_intents
                FOR UPDATE SKIP LOCKED
            ))
        RETURNING i.*;
END
$$;

-- Seconds until the next PENDING intent matching a claim's filters becomes due, if one is
-- scheduled in the future: a long-polling claimer that found nothing sleeps that long.
CREATE FUNCTION outbox.next_due_in(
    tenants text,
    cross_tenant text,
    worker_region text,
    kinds text[],
    as_of timestamptz
) RETURNS float8
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
BEGIN
    PERFORM outbox.enter_scope(tenants, cross_tenant);
    RETURN (
        SELECT extract(epoch FROM p.available_at - coalesce(as_of, now()))::float8
        FROM outbox.intent p
        WHERE p.state = 'pending'
          AND p.available_at > coalesce(as_of, now())
          AND (worker_region = '' OR p.region = '' OR p.region = worker_region)
          AND (cardinality(kinds) = 0 OR p.kind = ANY (kinds))
        ORDER BY p.available_at
        LIMIT 1
    );
END
$$;

-- Marks the leased intents DELIVERED: `intent_ids[k]` under lease `lease_ids[k]`, from the
-- live lease (LEASED, SUBMITTED, even expired but not yet rescued) or from the last lease
-- of a NEEDS_RECONCILE intent. Returns the intents it changed; the caller matches them to
-- its items. Planned once per connection, as a nested loop of primary-key lookups over the
-- batch: planning it per call cost more than running it (0.56 of 0.74 ms a call), and a
-- plan left free to choose, made while the table was small, was a merge join over the
-- whole primary key (or, on a young table, a sequential scan) that stayed.
CREATE FUNCTION outbox.ack(
    tenants text,
    cross_tenant text,
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
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
#variable_conflict use_column
BEGIN
    PERFORM outbox.enter_scope(tenants, cross_tenant);
    RETURN QUERY
        UPDATE outbox.intent i
        SET state = 'delivered',
            lease_expires_at = NULL,
            claim_request_id = NULL,
            finished_at = coalesce(as_of, now()),
            updated_at = coalesce(as_of, now())
        FROM unnest(intent_ids, lease_ids) AS input(id, lease_id)
        WHERE i.id = input.id
          AND i.lease_id = input.lease_id
          AND i.state IN ('leased', 'submitted', 'needs_reconcile')
        RETURNING i.id, i.state, i.lease_expires_at, i.headers->>'traceparent';
END
$$;
