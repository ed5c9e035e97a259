-- …20's outbox.ack, …14's ack_into_batches and …06's ack_and_delete (ordered intents acked
-- in place), …09's readers of the history (its items without keys); then the keys' column
-- goes, with the keys of the ordered intents acked into the history meanwhile.

-- …20's in-place Ack, which both call.
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
DECLARE
    done_ids uuid[];
    done_states outbox.intent_state[];
    done_expiries timestamptz[];
    done_traceparents text[];
    key_tenants text[];
    key_names text[];
BEGIN
    PERFORM outbox.enter_scope(tenants, scope_proof);
    -- Kept in arrays, so that the ordered intents' keys come from the UPDATE itself (read
    -- again by id, a plan on the delivered state walked every DELIVERED row).
    WITH done AS (
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
        RETURNING i.id, i.state, i.lease_expires_at, i.headers->>'traceparent' AS traceparent,
                  i.tenant_id, i.ordering_key
    )
    SELECT array_agg(d.id), array_agg(d.state), array_agg(d.lease_expires_at),
           array_agg(d.traceparent),
           array_agg(d.tenant_id) FILTER (WHERE d.ordering_key IS NOT NULL),
           array_agg(d.ordering_key) FILTER (WHERE d.ordering_key IS NOT NULL)
    INTO done_ids, done_states, done_expiries, done_traceparents, key_tenants, key_names
    FROM done d;
    RETURN QUERY
        SELECT * FROM unnest(done_ids, done_states, done_expiries, done_traceparents);
    -- An ordered intent delivered: the next of its key takes its place, returned as a
    -- PENDING row of its own so that the server wakes claimers after the commit.
    IF key_names IS NOT NULL THEN
        RETURN QUERY
            SELECT r.id, 'pending'::outbox.intent_state, NULL::timestamptz, NULL::text
            FROM outbox.release_keys(key_tenants, key_names, as_of) AS r(id);
    END IF;
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
              AND i.ordering_key IS NULL
              AND i.priority = 0
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
          AND i.ordering_key IS NULL
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

-- The history's items have no ordering key and priority 0 (…06 added the key's columns).
CREATE OR REPLACE FUNCTION outbox.intents_by_id(wanted_ids uuid[]) RETURNS SETOF outbox.intent
LANGUAGE sql STABLE
AS $$
    SELECT * FROM outbox.intent i WHERE i.id = ANY (wanted_ids)
    UNION ALL
    SELECT x.*, NULL::text, NULL::timestamptz, NULL::bigint, 0::smallint, NULL::bigint
    FROM outbox.delivered_batch b
    CROSS JOIN LATERAL unnest(b.items) x
    WHERE b.bucket = ANY ((
            SELECT array_agg(DISTINCT outbox.history_bucket(w)) FROM unnest(wanted_ids) w
          )::bigint[])
      AND (cardinality(wanted_ids) > 16 OR b.ids && wanted_ids)
      AND x.id IN (SELECT unnest(wanted_ids))
$$;

CREATE OR REPLACE VIEW outbox.all_intents WITH (security_invoker = true) AS
    SELECT * FROM outbox.intent
    UNION ALL
    SELECT x.*, NULL::text, NULL::timestamptz, NULL::bigint, 0::smallint, NULL::bigint
    FROM outbox.delivered_batch b CROSS JOIN LATERAL unnest(b.items) x;

DROP FUNCTION outbox.ack_the_rest(uuid[], uuid[], timestamptz, bigint, boolean);
ALTER TABLE outbox.delivered_batch DROP CONSTRAINT delivered_batch_keys_match_items;
ALTER TABLE outbox.delivered_batch DROP COLUMN ordering_keys;
