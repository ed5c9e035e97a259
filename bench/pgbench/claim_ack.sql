-- Raw-SQL ceiling of the burn-down: one Claim and one Ack as outboxd runs them, with no
-- service in between. Each is its own transaction that first sets the tenant scope exactly
-- as src/outbox/store/access.rs does (with the plan settings of AlsoAtBegin, as the server runs each);
-- the claim is the statement of src/outbox/store/claim.rs
-- (lease_next, no kind or region filter, 30 s lease) and the ack the statement of
-- ack_intents in src/outbox/store/settle.rs. Differences, on purpose: the claimed rows are
-- aggregated into two arrays server-side (pgbench's \gset takes one row), so payloads are
-- not shipped to the client. Variables: -D batch=N.
BEGIN;
SELECT set_config('outbox.tenants', 'bench', true), set_config('outbox.cross_tenant', 'off', true);
SET LOCAL plan_cache_mode = force_generic_plan;
SET LOCAL enable_seqscan = off;
SET LOCAL enable_bitmapscan = off;
WITH claimed AS (
    UPDATE outbox.intent i
    SET state = 'leased',
        attempts = i.attempts + 1,
        lease_id = gen_random_uuid(),
        lease_expires_at = coalesce(NULL::timestamptz, now()) + 30000 * interval '1 ms',
        worker_id = 'pgbench',
        claim_request_id = NULL,
        updated_at = coalesce(NULL::timestamptz, now())
    WHERE i.ctid = ANY (ARRAY(
            SELECT ctid
            FROM outbox.intent
            WHERE state = 'pending'
              AND available_at <= coalesce(NULL::timestamptz, now())
              AND ('' = '' OR region = '' OR region = '')
              AND (cardinality('{}'::text[]) = 0 OR kind = ANY('{}'::text[]))
            ORDER BY available_at, id
            LIMIT :batch
            FOR UPDATE SKIP LOCKED
        ))
    RETURNING i.id, i.lease_id
)
SELECT coalesce(array_agg(id), '{}')::text AS ids, coalesce(array_agg(lease_id), '{}')::text AS leases
FROM claimed \gset
COMMIT;
BEGIN;
SELECT set_config('outbox.tenants', 'bench', true), set_config('outbox.cross_tenant', 'off', true);
SET LOCAL plan_cache_mode = force_generic_plan;
SET LOCAL enable_seqscan = off;
SET LOCAL enable_bitmapscan = off;
WITH input AS (
    SELECT * FROM unnest(CAST(:ids AS uuid[]), CAST(:leases AS uuid[])) WITH ORDINALITY AS t(id, lease_id, ord)
),
changed AS (
    UPDATE outbox.intent i
    SET state = 'delivered',
        lease_expires_at = NULL,
        claim_request_id = NULL,
        finished_at = coalesce(NULL::timestamptz, now()),
        updated_at = coalesce(NULL::timestamptz, now())
    FROM input
    WHERE i.id = input.id
      AND i.lease_id = input.lease_id
      AND i.state IN ('leased', 'submitted', 'needs_reconcile')
    RETURNING i.id, i.state, i.lease_expires_at, i.headers->>'traceparent' AS traceparent
)
SELECT input.id,
       changed.state,
       changed.lease_expires_at,
       changed.traceparent
FROM input
LEFT JOIN changed ON changed.id = input.id
ORDER BY input.ord;
COMMIT;
