-- Undoes …06: ordered intents become unordered (WAITING ones PENDING), and the functions
-- …02_baseline_functions defined are restored as they were.
UPDATE outbox.intent SET state = 'pending' WHERE state = 'waiting';

DROP VIEW outbox.all_intents;
DROP FUNCTION outbox.advance_keys(text[], text[], timestamptz);
DROP FUNCTION outbox.lock_ordering_keys(text, text[]);
DROP FUNCTION outbox.commit_time(xid8);
DROP FUNCTION outbox.ordering_lock(text, text);
DROP INDEX outbox.intent_ordering_waiting_idx;
DROP INDEX outbox.intent_ordering_head_idx;
DROP SEQUENCE outbox.intent_order_seq;

ALTER TABLE outbox.intent
    DROP CONSTRAINT intent_waiting_is_ordered,
    DROP CONSTRAINT intent_ordered_is_complete,
    DROP COLUMN order_seq,
    DROP COLUMN order_ts,
    DROP COLUMN ordering_key;

CREATE OR REPLACE FUNCTION outbox.ack(
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

CREATE OR REPLACE FUNCTION outbox.ack_into_batches(
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

CREATE OR REPLACE FUNCTION outbox.ack_and_delete(
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

CREATE OR REPLACE FUNCTION outbox.intents_by_id(wanted_ids uuid[]) RETURNS SETOF outbox.intent
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

CREATE VIEW outbox.all_intents WITH (security_invoker = true) AS
    SELECT * FROM outbox.intent
    UNION ALL
    SELECT x.* FROM outbox.delivered_batch b CROSS JOIN LATERAL unnest(b.items) x;

SELECT outbox.regrant_service_roles();
