-- An Ack moves the ordered intents it delivers (without an idempotency key, at priority 0)
-- into the batch history too, with their keys, instead of marking them DELIVERED in place
-- (and deletes them at retention zero): one row version less each (the in-place UPDATE was
-- the ordered Ack's second costliest statement), and the live table keeps the size of the
-- backlog. A history row holds its items' ordering keys in ordering_keys, in the items'
-- order (NULL in a row without ordered items); the readers unnest them beside the items,
-- where outbox.intent has ordering_key. Both Acks' first statements are as before; what
-- they leave is outbox.ack_the_rest's, no longer outbox.ack's.

ALTER TABLE outbox.delivered_batch ADD COLUMN ordering_keys text[];
-- NOT VALID: the rows before this one have none, and checking them would read the history.
ALTER TABLE outbox.delivered_batch ADD CONSTRAINT delivered_batch_keys_match_items
    CHECK (ordering_keys IS NULL OR cardinality(ordering_keys) = cardinality(ids)) NOT VALID;

-- What an Ack's first statement left after it took `done` intents (those without an
-- idempotency or ordering key): first what stays is marked DELIVERED in place (idempotency
-- keys; priorities other than 0 above retention zero, a history item having none), as
-- before this migration, so that their Acks cost no more; then, if some are left, the
-- ordered ones without an idempotency key leave the live table, into the history with
-- their keys (into_history) or deleted (retention zero). Lost leases and replays match
-- neither. Then, all their rows locked, the keys of both move on in one round
-- (outbox.release_keys: an Ack locks its heads, then their keys, then the next intents),
-- returned as PENDING rows of their own so that the server wakes claimers after the
-- commit. Runs in the Ack's scope.
CREATE FUNCTION outbox.ack_the_rest(
    intent_ids uuid[],
    lease_ids uuid[],
    delivered_at timestamptz,
    done bigint,
    into_history boolean
) RETURNS TABLE (
    id uuid,
    state outbox.intent_state,
    lease_expires_at timestamptz,
    traceparent text
)
LANGUAGE plpgsql VOLATILE
AS $$
#variable_conflict use_column
DECLARE
    done_ids uuid[];
    done_traceparents text[];
    key_tenants text[];
    key_names text[];
BEGIN
    WITH marked AS (
        UPDATE outbox.intent i
        SET state = 'delivered',
            lease_expires_at = NULL,
            claim_request_id = NULL,
            finished_at = delivered_at,
            updated_at = delivered_at
        FROM unnest(intent_ids, lease_ids) AS input(id, lease_id)
        WHERE i.id = ANY (intent_ids)
          AND i.id = input.id
          AND i.lease_id = input.lease_id
          AND i.state IN ('leased', 'submitted', 'needs_reconcile')
          AND (i.ordering_key IS NULL OR i.idempotency_key IS NOT NULL
               OR (i.priority <> 0 AND into_history))
        RETURNING i.id, i.headers->>'traceparent' AS traceparent, i.tenant_id, i.ordering_key
    )
    SELECT array_agg(m.id), array_agg(m.traceparent),
           array_agg(m.tenant_id) FILTER (WHERE m.ordering_key IS NOT NULL),
           array_agg(m.ordering_key) FILTER (WHERE m.ordering_key IS NOT NULL)
    INTO done_ids, done_traceparents, key_tenants, key_names
    FROM marked m;
    IF done + coalesce(cardinality(done_ids), 0) < cardinality(intent_ids) THEN
        -- What the update left: its rows are DELIVERED now, outside the state test.
        WITH moved AS (
            DELETE FROM outbox.intent i
            USING unnest(intent_ids, lease_ids) AS input(id, lease_id)
            WHERE i.id = ANY (intent_ids)
              AND i.id = input.id
              AND i.lease_id = input.lease_id
              AND i.state IN ('leased', 'submitted', 'needs_reconcile')
            RETURNING i.*
        ),
        stored AS (
            -- As outbox.ack_into_batches stores the unordered ones, with the keys (one Agg
            -- node: the arrays in the same order).
            INSERT INTO outbox.delivered_batch (bucket, tenant_id, region, finished_at, ids,
                                                items, ordering_keys)
            SELECT outbox.history_bucket(d.id), d.tenant_id, d.region, delivered_at,
                   array_agg(d.id),
                   array_agg(ROW(
                       d.id, d.tenant_id, d.kind, d.region, d.payload, d.content_type,
                       d.headers, NULL, 'delivered', d.attempts, d.max_attempts,
                       d.available_at, d.created_at, delivered_at, d.lease_id, NULL,
                       d.worker_id, NULL, d.last_error, delivered_at, d.txn_xid
                   )::outbox.delivered_intent_v1),
                   array_agg(d.ordering_key)
            FROM moved d
            WHERE into_history
            GROUP BY outbox.history_bucket(d.id), d.tenant_id, d.region
        )
        SELECT done_ids || array_agg(d.id),
               done_traceparents || array_agg(d.headers->>'traceparent'),
               key_tenants || array_agg(d.tenant_id), key_names || array_agg(d.ordering_key)
        INTO done_ids, done_traceparents, key_tenants, key_names
        FROM moved d;
    END IF;
    RETURN QUERY
        SELECT u.id, 'delivered'::outbox.intent_state, NULL::timestamptz, u.traceparent
        FROM unnest(done_ids, done_traceparents) AS u(id, traceparent);
    IF key_names IS NOT NULL THEN
        RETURN QUERY
            SELECT r.id, 'pending'::outbox.intent_state, NULL::timestamptz, NULL::text
            FROM outbox.release_keys(key_tenants, key_names, delivered_at) AS r(id);
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
        RETURN QUERY
            SELECT * FROM outbox.ack_the_rest(intent_ids, lease_ids, delivered_at, moved, true);
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
        RETURN QUERY
            SELECT * FROM outbox.ack_the_rest(intent_ids, lease_ids, coalesce(as_of, now()),
                                              deleted, false);
    END IF;
END
$$;

-- x.unnest is the item's ordering key: a multi-argument unnest appends it after the item's
-- columns, which is where outbox.intent has ordering_key.
CREATE OR REPLACE FUNCTION outbox.intents_by_id(wanted_ids uuid[]) RETURNS SETOF outbox.intent
LANGUAGE sql STABLE
AS $$
    SELECT * FROM outbox.intent i WHERE i.id = ANY (wanted_ids)
    UNION ALL
    SELECT x.*, NULL::timestamptz, NULL::bigint, 0::smallint, NULL::bigint
    FROM outbox.delivered_batch b
    CROSS JOIN LATERAL unnest(b.items, b.ordering_keys) x
    WHERE b.bucket = ANY ((
            SELECT array_agg(DISTINCT outbox.history_bucket(w)) FROM unnest(wanted_ids) w
          )::bigint[])
      AND (cardinality(wanted_ids) > 16 OR b.ids && wanted_ids)
      AND x.id IN (SELECT unnest(wanted_ids))
$$;

CREATE OR REPLACE VIEW outbox.all_intents WITH (security_invoker = true) AS
    SELECT * FROM outbox.intent
    UNION ALL
    SELECT x.*, NULL::timestamptz, NULL::bigint, 0::smallint, NULL::bigint
    FROM outbox.delivered_batch b CROSS JOIN LATERAL unnest(b.items, b.ordering_keys) x;

-- Its work is outbox.ack_the_rest's now.
DROP FUNCTION outbox.ack(text, text, uuid[], uuid[], timestamptz);
