-- Per-key ordering (docs/ordering.md). Among the intents of one tenant and ordering key,
-- one at a time is the key's head: STAGED, PENDING, LEASED, SUBMITTED, NEEDS_RECONCILE, or
-- DEAD_LETTERED without an operator's decision. The others are WAITING, outside the
-- claimable index, so that a key's backlog costs a claim nothing. When the head finishes,
-- outbox.advance_keys makes the next of its key PENDING, in the transaction that finished
-- it.
--
-- "Next" is commit order: the intents of a transaction that committed earlier come first,
-- those of one transaction in the order they were inserted. PostgreSQL records when a
-- transaction committed only with track_commit_timestamp on, so ordered intents need it
-- (outbox.lock_ordering_keys tells). Every ordered intent carries the transaction that
-- made it exist (txn_xid: the producer's for a two-phase Enqueue, outboxd's own for a
-- direct one) and, once known, that transaction's commit time.
ALTER TABLE outbox.intent
    ADD COLUMN ordering_key text,
    -- Commit time of txn_xid: set when a STAGED intent's transaction commits, and for a
    -- direct one by the first advance of its key after its commit.
    ADD COLUMN order_ts timestamptz,
    -- Ties within one transaction (and of equal commit times): insertion order.
    ADD COLUMN order_seq bigint,
    ADD CONSTRAINT intent_ordered_is_complete CHECK (
        ordering_key IS NULL OR (txn_xid IS NOT NULL AND order_seq IS NOT NULL)
    ),
    ADD CONSTRAINT intent_waiting_is_ordered CHECK (state <> 'waiting' OR ordering_key IS NOT NULL);

CREATE SEQUENCE outbox.intent_order_seq;

-- A key's head, if any: what outbox.advance_keys tests, and what the queue statistics count
-- as blocked keys. `ordering_key IS NOT NULL` keeps it off every statement that does not
-- name a key (settles, claims), whose state tests would otherwise match its predicate.
CREATE INDEX intent_ordering_head_idx ON outbox.intent (tenant_id, ordering_key, state)
    WHERE ordering_key IS NOT NULL
      AND state IN ('staged', 'pending', 'leased', 'submitted', 'needs_reconcile',
                    'dead_lettered');

-- A key's WAITING intents in commit order; those whose commit time is not known yet last.
CREATE INDEX intent_ordering_waiting_idx
    ON outbox.intent (tenant_id, ordering_key, order_ts, order_seq)
    WHERE state = 'waiting';

-- The advisory lock of one ordering key: held by a direct Enqueue of the key until its
-- commit is visible, and by whoever advances the key. Always taken in the order of this
-- number, so that transactions taking several never wait on each other in a cycle.
CREATE FUNCTION outbox.ordering_lock(tenant text, ordering_key text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN hashtextextended('outbox.ordering_key' || chr(31) || tenant || chr(31) || ordering_key, 0);

-- When transaction `xid` committed (NULL: too old to tell).
CREATE FUNCTION outbox.commit_time(xid xid8) RETURNS timestamptz
LANGUAGE sql STABLE
RETURN pg_xact_commit_timestamp((xid::text::numeric % 4294967296)::text::xid);

-- Called before an Enqueue inserts ordered intents: false, and nothing locked, when
-- PostgreSQL does not record commit times (the caller refuses the intents); else true, the
-- keys' locks taken in lock order and held to the end of the transaction.
CREATE FUNCTION outbox.lock_ordering_keys(tenant text, ordering_keys text[]) RETURNS boolean
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    lock_id bigint;
BEGIN
    IF NOT current_setting('track_commit_timestamp')::boolean THEN
        RETURN false;
    END IF;
    FOR lock_id IN
        SELECT DISTINCT outbox.ordering_lock(tenant, k)
        FROM unnest(ordering_keys) AS k
        WHERE k IS NOT NULL
        ORDER BY 1
    LOOP
        PERFORM pg_advisory_xact_lock(lock_id);
    END LOOP;
    RETURN true;
END
$$;

-- Makes the next WAITING intent of each (tenants[k], ordering_keys[k]) PENDING where the
-- key has no head, and returns those intents: the keys' locks in lock order, then one
-- statement per step for all the keys (an Ack of 1,000 ordered intents moves 1,000 keys).
-- A key with a STAGED intent waits for that transaction to end (the promotion advances it
-- then): it may yet commit before the transactions of the WAITING ones.
--
-- Every WAITING intent of another transaction has committed (a direct Enqueue holds the
-- key's lock until its commit is visible), so its commit time can be read; the caller's
-- own come after them all, as its transaction commits last. Commit times are read while
-- PostgreSQL still has them (it forgets them with the commit log, after a few hundred
-- million transactions), also behind a head that stays blocked: each direct Enqueue of a
-- key fills in the ones before it.
CREATE FUNCTION outbox.advance_keys(tenants text[], ordering_keys text[], as_of timestamptz)
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

    UPDATE outbox.intent i
    SET order_ts = coalesce(outbox.commit_time(i.txn_xid), '-infinity')
    FROM unnest(key_tenants, key_names) AS k(tenant, ordering_key)
    WHERE i.tenant_id = k.tenant
      AND i.ordering_key = k.ordering_key
      AND i.state = 'waiting'
      AND i.order_ts IS NULL
      AND i.txn_xid IS DISTINCT FROM own;

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

-- The Acks. outbox.ack advances the keys of the ordered intents it delivers; the two that
-- move intents out of this table leave ordered ones to it, delivered in place, so that
-- they keep their key until the retention purges them.
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

-- The history's items have no ordering key: ordered intents never go there.
CREATE OR REPLACE FUNCTION outbox.intents_by_id(wanted_ids uuid[]) RETURNS SETOF outbox.intent
LANGUAGE sql STABLE
AS $$
    SELECT * FROM outbox.intent i WHERE i.id = ANY (wanted_ids)
    UNION ALL
    SELECT x.*, NULL::text, NULL::timestamptz, NULL::bigint
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
    SELECT x.*, NULL::text, NULL::timestamptz, NULL::bigint
    FROM outbox.delivered_batch b CROSS JOIN LATERAL unnest(b.items) x;

SELECT outbox.regrant_service_roles();
