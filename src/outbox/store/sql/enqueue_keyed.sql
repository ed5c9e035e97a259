-- Enqueue of a batch with idempotency keys (store::insert_intents). The parameters are
-- enqueue.sql's ($14 and $15 NULL: a keyed batch is never handed off). One row per intent,
-- in request order: whether it was inserted and, if its key was held, by which intent.
--
-- Intents without a key are inserted plainly, those with one with ON CONFLICT DO NOTHING:
-- with an ON CONFLICT clause every row is a speculative insertion (a lock taken and
-- released, and one more WAL record), 10-17% of pgbench's batched-insert throughput.
WITH input AS (
    -- An ordered intent's place among those of its transaction: request order, here, as
    -- the two inserts below run in no set order.
    SELECT *, CASE WHEN t.ordering_key IS NOT NULL
                   THEN nextval('outbox.intent_order_seq') END AS order_seq
    FROM unnest($2::uuid[], $3::text[], $4::text[], $5::bytea[], $6::text[], $7::text[],
                $8::jsonb[], $9::int[], $10::bigint[], $11::timestamptz[],
                $14::text[], $15::bigint[], $16::text[], $17::smallint[])
        WITH ORDINALITY
        AS t(id, kind, region, payload, content_type, idempotency_key,
             headers, max_attempts, delay_ms, at, lease_worker, lease_ms, ordering_key,
             priority, ord)
),
levels AS (
    -- As in enqueue.sql.
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
),
unkeyed AS (
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
           CASE WHEN input.lease_worker IS NOT NULL THEN 1 ELSE 0 END,
           CASE WHEN input.lease_worker IS NOT NULL THEN gen_random_uuid() END,
           clock.now + input.lease_ms * interval '1 ms',
           input.lease_worker,
           input.ordering_key,
           input.order_seq,
           coalesce(input.priority, 0),
           hashtextextended($1 || '/' || input.kind, coalesce(input.priority, 0))
    FROM input, clock
    WHERE input.idempotency_key IS NULL
    ORDER BY input.ord
    RETURNING id
),
keyed AS (
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
           CASE WHEN input.lease_worker IS NOT NULL THEN 1 ELSE 0 END,
           CASE WHEN input.lease_worker IS NOT NULL THEN gen_random_uuid() END,
           clock.now + input.lease_ms * interval '1 ms',
           input.lease_worker,
           input.ordering_key,
           input.order_seq,
           coalesce(input.priority, 0),
           hashtextextended($1 || '/' || input.kind, coalesce(input.priority, 0))
    FROM input, clock
    WHERE input.idempotency_key IS NOT NULL
    ORDER BY input.ord
    ON CONFLICT (tenant_id, idempotency_key)
        WHERE idempotency_key IS NOT NULL AND state <> 'discarded'
    DO NOTHING
    RETURNING id
),
inserted AS (
    SELECT id FROM unkeyed UNION ALL SELECT id FROM keyed
)
SELECT input.id AS new_id,
       inserted.id IS NOT NULL AS inserted,
       existing.id AS existing_id,
       existing.state AS existing_state,
       existing.txn_xid::text AS existing_txn,
       (existing.kind = input.kind AND existing.payload = input.payload
        AND existing.region = input.region) AS same_content
FROM input
LEFT JOIN inserted ON inserted.id = input.id
LEFT JOIN outbox.intent existing
    ON inserted.id IS NULL
   AND existing.tenant_id = $1
   AND existing.idempotency_key = input.idempotency_key
   AND existing.state <> 'discarded'
ORDER BY input.ord
