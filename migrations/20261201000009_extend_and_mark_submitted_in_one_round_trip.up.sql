-- ExtendLease and MarkSubmitted as Ack is (migration 20261201000007): one statement in
-- its own implicit transaction, scoped for row-level security as outboxd's BEGIN does,
-- planned once per connection as a nested loop of primary-key lookups over the batch.
-- Each was three round trips (BEGIN with the scope, the statement, COMMIT) and planned per
-- call, which for Ack cost more than running it (0.56 of 0.74 ms). A worker that calls
-- MarkSubmitted before every non-idempotent side effect pays it once per intent.
-- Each returns the intents it changed; the caller matches them to its items.
--
-- All three settles also test `i.id = ANY (intent_ids)`: that condition is an index
-- condition whatever the statistics, so each reads the batch's intents by primary key. A
-- plan made while the table was tiny (a new deployment), and cached for the connection's
-- life, joined the batch to a full scan of the primary key instead, and kept doing so
-- after the table grew: Ack had that plan (seen with auto_explain on a fresh database).
-- ExtendLease's and MarkSubmitted's state tests are written on the state as text: as
-- enum tests they imply the predicate of intent_lease_expires_at_idx, and a plan made on a
-- tiny table scanned that whole index (every live lease) instead of the primary key.

-- Pushes the expiry of live (LEASED or SUBMITTED) leases to `as_of + lease_ms`.
CREATE FUNCTION outbox.extend_leases(
    tenants text,
    cross_tenant text,
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
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
#variable_conflict use_column
BEGIN
    PERFORM outbox.enter_scope(tenants, cross_tenant);
    RETURN QUERY
        UPDATE outbox.intent i
        SET lease_expires_at = coalesce(as_of, now()) + lease_ms * interval '1 ms',
            updated_at = coalesce(as_of, now())
        FROM unnest(intent_ids, lease_ids) AS input(id, lease_id)
        WHERE i.id = ANY (intent_ids)
          AND i.id = input.id
          AND i.lease_id = input.lease_id
          -- As text: see the note above on the lease-expiry index.
          AND i.state::text IN ('leased', 'submitted')
        RETURNING i.id, i.state, i.lease_expires_at, i.headers->>'traceparent';
END
$$;

-- Moves LEASED intents to SUBMITTED: from then on a lost outcome needs an operator.
CREATE FUNCTION outbox.mark_submitted(
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
        SET state = 'submitted',
            updated_at = coalesce(as_of, now())
        FROM unnest(intent_ids, lease_ids) AS input(id, lease_id)
        WHERE i.id = ANY (intent_ids)
          AND i.id = input.id
          AND i.lease_id = input.lease_id
          -- As text: see the note above on the lease-expiry index.
          AND i.state::text = 'leased'
        RETURNING i.id, i.state, i.lease_expires_at, i.headers->>'traceparent';
END
$$;

-- Marks the leased intents DELIVERED: `intent_ids[k]` under lease `lease_ids[k]`, from the
-- live lease (LEASED, SUBMITTED, even expired but not yet rescued) or from the last lease
-- of a NEEDS_RECONCILE intent. Returns the intents it changed; the caller matches them to
-- its items. Planned once per connection, as a nested loop of primary-key lookups over the
-- batch: planning it per call cost more than running it (0.56 of 0.74 ms a call), and a
-- plan left free to choose, made while the table was small, was a merge join over the
-- whole primary key (or, on a young table, a sequential scan) that stayed.
CREATE OR REPLACE FUNCTION outbox.ack(
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
        WHERE i.id = ANY (intent_ids)
          AND i.id = input.id
          AND i.lease_id = input.lease_id
          AND i.state IN ('leased', 'submitted', 'needs_reconcile')
        RETURNING i.id, i.state, i.lease_expires_at, i.headers->>'traceparent';
END
$$;
