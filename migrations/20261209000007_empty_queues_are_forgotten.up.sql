-- A queue (a tenant's kind) found without a live intent for an hour is forgotten: its
-- levels leave outbox.queue_level, so that claims stop walking them and the tenant's cap of
-- 1,000 counts the queues in use, not every queue it ever had. The next intent of the
-- queue registers it again.
--
-- Forgetting must never race an Enqueue of the queue: the Enqueue statements (and the
-- insert trigger) hold the queue's advisory lock shared, taken before they probe the level
-- and kept to their commit; the sweep (store::forget_empty_queues) takes it alone, without
-- waiting, before it looks for live intents. So an intent the sweep cannot see yet belongs
-- to a transaction whose probe comes after the sweep's commit, and registers its level anew.

-- When the sweeps first found the level without a live intent (NULL: it has one).
ALTER TABLE outbox.queue_level ADD COLUMN empty_since timestamptz;

-- The queue's advisory lock key (one bigint; the prefix keeps it apart from outboxd's other
-- advisory locks): one of 16 per tenant, which its queues share, so that an Enqueue of a
-- thousand kinds holds 16 locks, not a thousand, in PostgreSQL's shared lock table.
CREATE FUNCTION outbox.queue_lock_key(tenant_id text, kind text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT hashtextextended('outbox.queue/' || tenant_id, hashtext(kind) & 15) $$;

-- The sweep's look for live intents of a level outside the claimable index and the leases':
-- staged, waiting, and those an operator must decide on. Not for PENDING, LEASED or SUBMITTED
-- rows, so that no claim, settle or Enqueue of an unordered intent writes an entry here.
CREATE INDEX intent_level_parked_idx ON outbox.intent (level_key)
    WHERE state IN ('staged', 'waiting', 'needs_reconcile', 'dead_lettered');

-- Registers the levels of inserted intents, once per statement, each under its queue's
-- lock (above). ON CONFLICT DO NOTHING only probes the key when the level exists (no row
-- lock, no WAL).
CREATE OR REPLACE FUNCTION outbox.register_queue_levels() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    INSERT INTO outbox.queue_level (tenant_id, kind, priority)
    SELECT n.tenant_id, n.kind, n.priority
    FROM (SELECT DISTINCT n.tenant_id, n.kind, n.priority FROM new_intents n) n
    CROSS JOIN LATERAL (
        SELECT pg_advisory_xact_lock_shared(outbox.queue_lock_key(n.tenant_id, n.kind))
    ) AS held
    ON CONFLICT DO NOTHING;
    RETURN NULL;
END
$$;

-- Only the fleet forgets queues (the sweep runs as it).
GRANT DELETE ON outbox.queue_level TO outboxd_fleet;
