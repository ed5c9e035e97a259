-- One look of a claim (store::claim_intents). $1 tenants, $2 their proof, $3 worker,
-- $4 region, $5 kinds, $6 most intents, $7 lease milliseconds, $8 request id, $9 now (or
-- NULL), $10-$13 the levels' floors (tenants, kinds, priorities, instants), $14 the byte
-- budget.
--
-- One row per leased intent (its columns in the order of store::INTENT_COLUMN_NAMES), or a
-- single row of NULLs; each with next_due_in when fewer than asked were leased within the
-- budget (the queue ran out), ran_out, replayed (a claim that leased has written, so its
-- transaction has an id, and a replay only reads), and the leases
-- limits refused (set by outbox.claim for the statement's transaction), whether the
-- transaction commits without waiting for its flush (a limited queue's), and when the
-- server it ran on started, its backend and when its statement began (store::flush: a
-- flush on another server, or on a backend younger than the claim, cannot prove it
-- durable).
WITH leased AS MATERIALIZED (
    SELECT * FROM outbox.claim($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)
),
outcome AS MATERIALIZED (
    -- Once a statement, not once a row (so is due); after the function has run (this
    -- reads leased).
    SELECT CASE WHEN counted.n >= $6 THEN false
               -- The weights are summed only when fewer than asked were leased (a full
               -- batch, the busy queue's case, did not run out).
               ELSE (SELECT coalesce(sum(outbox.reply_weight(l.payload, l.headers,
                                                             l.last_error)), 0) < $14
                     FROM leased l)
           END AS ran_out,
           pg_current_xact_id_if_assigned() IS NULL AS replayed,
           coalesce(nullif(current_setting('outbox.refused_by_limit', true), ''), '0')::int
               AS refused_by_limit,
           current_setting('synchronous_commit') = 'off' AS unflushed,
           pg_postmaster_start_time() AS incarnation,
           pg_backend_pid() AS backend,
           now() AS began
    FROM (SELECT count(*) AS n FROM leased) counted
),
due AS MATERIALIZED (
    SELECT outbox.next_due_in($1, $2, $4, $5, $9) AS seconds
    FROM outcome
    WHERE ran_out
)
SELECT i.id, i.state, i.kind, i.payload, i.content_type, i.region, i.idempotency_key,
       i.headers, i.attempts, i.max_attempts, i.available_at, i.created_at, i.updated_at,
       i.lease_id, i.lease_expires_at, i.worker_id, i.last_error, i.ordering_key, i.priority,
       i.tenant_id AS tenant, due.seconds AS next_due_in, s.replayed, s.ran_out, s.refused_by_limit,
       s.unflushed, s.incarnation, s.backend, s.began
FROM outcome s
LEFT JOIN leased i ON true
LEFT JOIN due ON true
