-- Enqueue of a batch without idempotency keys, some of its intents handed off to waiting
-- claimers (inserted LEASED to them): enqueue.sql, returning those intents (their columns
-- in the order of store::INTENT_COLUMN_NAMES). The parameters are enqueue.sql's; $14 and
-- $15 are the worker and lease ms of each intent (NULL: not handed off). An intent of a
-- queue with a policy (paused, limited) is inserted PENDING instead: only a claim applies
-- a policy.
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
inserted AS (
    INSERT INTO outbox.intent (id, tenant_id, kind, region, payload, content_type,
                               idempotency_key, headers, state, max_attempts,
                               available_at, created_at, updated_at, txn_xid,
                               attempts, lease_id, lease_expires_at, worker_id,
                               ordering_key, order_seq, priority, level_key)
    SELECT input.id, $1, input.kind, input.region, input.payload, input.content_type,
           input.idempotency_key, input.headers,
           CASE WHEN hand.worker IS NOT NULL THEN 'leased'
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
           CASE WHEN hand.worker IS NOT NULL THEN 1 ELSE 0 END,
           CASE WHEN hand.worker IS NOT NULL THEN gen_random_uuid() END,
           -- From this statement, not the transaction's start: the claimer was taken
           -- since, and its worker counts the lease from no earlier than its Claim's send.
           CASE WHEN hand.worker IS NOT NULL
                THEN coalesce($12::timestamptz, statement_timestamp())
                     + input.lease_ms * interval '1 ms' END,
           hand.worker,
           input.ordering_key,
           CASE WHEN input.ordering_key IS NOT NULL
                THEN nextval('outbox.intent_order_seq') END,
           coalesce(input.priority, 0),
           hashtextextended($1 || '/' || input.kind, coalesce(input.priority, 0))
    FROM input
    CROSS JOIN clock
    LEFT JOIN LATERAL (
        SELECT input.lease_worker AS worker
        WHERE NOT EXISTS (
            SELECT 1 FROM outbox.queue_policy p
            WHERE p.tenant_id = $1 AND p.kind = input.kind
              AND (p.paused OR p.max_in_flight IS NOT NULL OR p.rate_per_second IS NOT NULL))
    ) hand ON true
    WHERE input.idempotency_key IS NULL
    ORDER BY input.ord
    RETURNING *
)
SELECT i.id, i.state, i.kind, i.payload, i.content_type, i.region, i.idempotency_key,
       i.headers, i.attempts, i.max_attempts, i.available_at, i.created_at, i.updated_at,
       i.lease_id, i.lease_expires_at, i.worker_id, i.last_error, i.ordering_key, i.priority,
       i.tenant_id AS tenant
FROM inserted i
WHERE i.state = 'leased'
