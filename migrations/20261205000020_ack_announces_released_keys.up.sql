-- An Ack that let ordering keys move on sent a NOTIFY in its own transaction, and
-- PostgreSQL commits notifying transactions one at a time (the notify queue's lock is held
-- across the commit and its WAL flush): the ordered burn-down's Acks queued for it, and
-- every waiting claim of every replica woke at each one. Now the Ack returns the intents it
-- made PENDING as rows of their own (state 'pending'; its own items are 'delivered'), and
-- the server wakes claimers after the commit as it does for its Enqueues (one claimer a
-- group, the other replicas by one coalesced NOTIFY).
--
-- release_keys is …18's advance_keys without the NOTIFY, and with its reads of a key's
-- rows kept as probes of each key (OFFSET 0 keeps PostgreSQL from turning them into
-- joins): as joins they were planned for the generic plan's ten keys, and the test for a
-- live head read every head of the tenant once for each key: 5M rows compared for an
-- Enqueue of 1,000 keys, ~7 ms of every ordered Ack of 100 in the burn-down.
-- advance_keys, for the callers that still notify in their transaction (promotion,
-- operator decisions, Enqueue), calls it.
--
-- During a rolling upgrade, an Ack served by a replica of the previous build wakes no
-- claimer when it releases a key (that build neither notifies nor announces): they look
-- again at their recheck, within 2 s.

CREATE FUNCTION outbox.release_keys(tenants text[], ordering_keys text[], as_of timestamptz)
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
        OFFSET 0
    );
    IF fill_names IS NOT NULL THEN
        UPDATE outbox.intent i
        SET order_ts = coalesce(outbox.commit_time(i.txn_xid), '-infinity')
        WHERE i.id IN (
            SELECT w.id
            FROM unnest(fill_tenants, fill_names) AS k(tenant, ordering_key)
            CROSS JOIN LATERAL (
                SELECT w.id
                FROM outbox.intent w
                WHERE w.tenant_id = k.tenant
                  AND w.ordering_key = k.ordering_key
                  AND w.state = 'waiting'
                  AND w.order_ts IS NULL
                  AND w.txn_xid IS DISTINCT FROM own
                OFFSET 0
            ) w
        )
          AND i.state = 'waiting'
          AND i.order_ts IS NULL;
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
                OFFSET 0
            )
        ) heads
        WHERE i.id = heads.id
        RETURNING i.id;
END
$$;

CREATE OR REPLACE FUNCTION outbox.advance_keys(tenants text[], ordering_keys text[], as_of timestamptz)
RETURNS SETOF uuid
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    RETURN QUERY SELECT r.id FROM outbox.release_keys(tenants, ordering_keys, as_of) AS r(id);
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
