-- The issue's reference loop, for calibrating the machine: the cheapest queue PostgreSQL
-- runs, not outboxd's statements. Claim :batch jobs oldest first (UPDATE ... FOR UPDATE
-- SKIP LOCKED, as graphile-worker and River do), then ack them by DELETE: bigint ids, one
-- partial index, no tenant scope, no lease ids and no history kept (outboxd keeps every
-- delivered intent until its retention has passed). Each statement is its own
-- transaction. The table is created and filled by outboxd-bench (src/bin/outboxd-bench/
-- peers.rs, `minimal_queue`). Variables: -D batch=N.
WITH claimed AS (
    UPDATE minimal.job
    SET locked_at = now(), locked_by = 'pgbench', attempts = attempts + 1
    WHERE id = ANY (ARRAY(
        SELECT id FROM minimal.job
        WHERE locked_at IS NULL AND run_at <= now()
        ORDER BY run_at, id
        LIMIT :batch
        FOR UPDATE SKIP LOCKED
    ))
    RETURNING id
)
SELECT coalesce(array_agg(id), '{}')::text AS ids FROM claimed \gset
DELETE FROM minimal.job WHERE id = ANY ((:ids)::bigint[]);
