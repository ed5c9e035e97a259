-- Restores …18's advance_keys (with its NOTIFY) and …06's ack, and drops release_keys.
CREATE OR REPLACE FUNCTION outbox.advance_keys(tenants text[], ordering_keys text[], as_of timestamptz)
RETURNS SETOF uuid
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
SET enable_bitmapscan = off
-- A key at a time through its indexes. Set here, not inherited: outbox.ack, which calls
-- it, turns nested loops off, and under its settings this plan read every head through a
-- hash anti join over the whole primary key (3.8 s instead of 0.3 ms).
SET enable_nestloop = on
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
DECLARE
    own xid8 := pg_current_xact_id_if_assigned();
    at timestamptz := coalesce(as_of, now());
    key_tenants text[];
    key_names text[];
    lock_ids bigint[];
    fill_tenants text[];
    fill_names text[];
BEGIN
    SELECT array_agg(u.tenant ORDER BY u.lock_id), array_agg(u.ordering_key ORDER BY u.lock_id),
           array_agg(u.lock_id ORDER BY u.lock_id)
    INTO key_tenants, key_names, lock_ids
    FROM (
        SELECT DISTINCT t.tenant, t.ordering_key,
               outbox.ordering_lock(t.tenant, t.ordering_key) AS lock_id
        FROM unnest(tenants, ordering_keys) AS t(tenant, ordering_key)
        WHERE t.ordering_key IS NOT NULL
    ) u;
    IF key_tenants IS NULL THEN
        RETURN;
    END IF;
    -- One statement, in the array's (lock) order.
    PERFORM pg_advisory_xact_lock(l) FROM unnest(lock_ids) AS l;

    -- Only a key whose WAITING intents include one with a commit time (a promoted
    -- two-phase intent) needs the others': direct Enqueues of a key hold its lock to
    -- their commit, so among them insertion order is commit order. The keys are chosen
    -- first, one probe each, so that the rows of the others (a million behind a blocked
    -- head, none of them filled) are never walked.
    SELECT array_agg(k.tenant), array_agg(k.ordering_key)
    INTO fill_tenants, fill_names
    FROM unnest(key_tenants, key_names) AS k(tenant, ordering_key)
    WHERE EXISTS (
        SELECT 1
        FROM outbox.intent t
        WHERE t.tenant_id = k.tenant
          AND t.ordering_key = k.ordering_key
          AND t.state = 'waiting'
          AND t.order_ts IS NOT NULL
    );
    IF fill_names IS NOT NULL THEN
        UPDATE outbox.intent i
        SET order_ts = coalesce(outbox.commit_time(i.txn_xid), '-infinity')
        FROM unnest(fill_tenants, fill_names) AS k(tenant, ordering_key)
        WHERE i.tenant_id = k.tenant
          AND i.ordering_key = k.ordering_key
          AND i.state = 'waiting'
          AND i.order_ts IS NULL
          AND i.txn_xid IS DISTINCT FROM own;
    END IF;

    -- Claimable from now on, as a promoted STAGED intent is (outbox::claim::floor).
    RETURN QUERY
        UPDATE outbox.intent i
        SET state = 'pending',
            available_at = greatest(i.available_at, at),
            updated_at = at
        FROM (
            SELECT next.id
            FROM unnest(key_tenants, key_names) AS k(tenant, ordering_key)
            CROSS JOIN LATERAL (
                SELECT w.id
                FROM outbox.intent w
                WHERE w.tenant_id = k.tenant
                  AND w.ordering_key = k.ordering_key
                  AND w.state = 'waiting'
                ORDER BY w.order_ts, w.order_seq
                LIMIT 1
            ) next
            WHERE NOT EXISTS (
                SELECT 1
                FROM outbox.intent h
                WHERE h.tenant_id = k.tenant
                  AND h.ordering_key = k.ordering_key
                  AND h.state IN ('staged', 'pending', 'leased', 'submitted', 'needs_reconcile',
                                  'dead_lettered')
                  AND (h.state <> 'dead_lettered' OR h.finished_at IS NULL)
            )
        ) heads
        WHERE i.id = heads.id
        RETURNING i.id;
    IF FOUND THEN
        PERFORM pg_notify('outbox_intent_pending', '');
    END IF;
END
$$;

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
    -- An ordered intent delivered: the next of its key takes its place.
    IF key_names IS NOT NULL THEN
        PERFORM outbox.advance_keys(key_tenants, key_names, as_of);
    END IF;
    RETURN QUERY
        SELECT * FROM unnest(done_ids, done_states, done_expiries, done_traceparents);
END
$$;

DROP FUNCTION outbox.release_keys(text[], text[], timestamptz);
