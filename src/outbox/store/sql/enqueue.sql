-- Enqueue of a batch without idempotency keys (store::insert_intents): every intent is
-- inserted under the id minted by outboxd, nothing returned. $1 tenant; per intent, in
-- request order: $2 id, $3 kind, $4 region, $5 payload, $6 content type, $7 idempotency
-- key (all NULL here), $8 headers, $9 max attempts, $10 delay ms, $11 due instant; $12 now
-- (or NULL), $13 the producer transaction (STAGED) or NULL (PENDING); per intent, $14 and
-- $15 the worker and lease ms of a handed-off intent (NULL arrays here), $16 the ordering
-- key (a NULL array: none), $17 the priority (a NULL array: all 0). A direct ordered
-- intent is WAITING, its transaction (this one) its txn_xid, until outbox.advance_keys
-- makes it its key's head; order_seq is taken in request order (the select list is
-- computed after the ORDER BY).
WITH input AS (
    SELECT *
    FROM unnest($2::uuid[], $3::text[], $4::text[], $5::bytea[], $6::text[], $7::text[],
                $8::jsonb[], $9::int[], $10::bigint[], $11::timestamptz[],
                $14::text[], $15::bigint[], $16::text[], $17::smallint[])
        WITH ORDINALITY
        AS t(id, kind, region, payload, content_type, idempotency_key,
             headers, max_attempts, delay_ms, at, lease_worker, lease_ms, ordering_key,
             priority, ord)
),
levels AS (
    -- The levels of these intents, for claims to walk (flow-control.md): a probe of the
    -- key when the level is known; the insert trigger skips this transaction
    -- (AlsoAtBegin::LevelsRegistered). From the arrays, not `input`, which a second
    -- reference would materialize, payloads and all. Each probe after its queue's lock,
    -- held shared to the commit, which the sweep forgetting empty queues takes alone
    -- (migration …07_empty_queues_are_forgotten).
    INSERT INTO outbox.queue_level (tenant_id, kind, priority)
    SELECT l.tenant_id, l.kind, l.priority
    FROM (SELECT DISTINCT $1::text AS tenant_id, l.kind, coalesce(l.priority, 0) AS priority
          FROM unnest($3::text[], $17::smallint[]) AS l (kind, priority)) AS l
    CROSS JOIN LATERAL (
        SELECT pg_advisory_xact_lock_shared(outbox.queue_lock_key(l.tenant_id, l.kind))
    ) AS held
    ON CONFLICT DO NOTHING
),
clock AS (
    SELECT coalesce($12::timestamptz, now()) AS now
)
INSERT INTO outbox.intent (id, tenant_id, kind, region, payload, content_type,
                           idempotency_key, headers, state, max_attempts,
                           available_at, created_at, updated_at, txn_xid,
                           attempts, lease_id, lease_expires_at, worker_id,
                           ordering_key, order_seq, priority, level_key)
SELECT input.id, $1, input.kind, input.region, input.payload, input.content_type,
       input.idempotency_key, input.headers,
       CASE WHEN input.lease_worker IS NOT NULL THEN 'leased'
            WHEN $13::text IS NOT NULL THEN 'staged'
            WHEN input.ordering_key IS NOT NULL THEN 'waiting'
            ELSE 'pending' END::outbox.intent_state,
       input.max_attempts,
       greatest(coalesce(input.at, clock.now + coalesce(input.delay_ms, 0) * interval '1 ms'), clock.now),
       clock.now, clock.now,
       coalesce($13::text::xid8,
                CASE WHEN input.ordering_key IS NOT NULL THEN pg_current_xact_id() END),
       -- A handed-off intent is leased as outbox.claim leases: the attempt counted, a
       -- fresh lease id.
       CASE WHEN input.lease_worker IS NOT NULL THEN 1 ELSE 0 END,
       CASE WHEN input.lease_worker IS NOT NULL THEN gen_random_uuid() END,
       clock.now + input.lease_ms * interval '1 ms',
       input.lease_worker,
       input.ordering_key,
       CASE WHEN input.ordering_key IS NOT NULL
            THEN nextval('outbox.intent_order_seq') END,
       coalesce(input.priority, 0),
       hashtextextended($1 || '/' || input.kind, coalesce(input.priority, 0))
FROM input, clock
WHERE input.idempotency_key IS NULL
ORDER BY input.ord
