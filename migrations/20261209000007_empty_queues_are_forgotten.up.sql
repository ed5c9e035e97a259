-- A queue (a tenant's kind) found without a live intent for an hour is forgotten: its
-- levels leave outbox.queue_level, so that claims stop walking them and the tenant's cap of
-- 1,000 counts the queues in use, not every queue it ever had. The next intent of the
-- queue registers it again.
--
-- Forgetting must never race an Enqueue of the queue: the Enqueue statements (and the
-- insert trigger) hold the queue's advisory lock shared, taken before they probe the level
-- and kept to their commit; the sweep (store::forget_empty_queues) takes it alone, without
-- waiting, before it looks again for live intents. So an intent the sweep cannot see yet
-- belongs to a transaction whose probe comes after the sweep's commit, and registers its
-- level anew.

-- Levels the sweeps found without a live intent, and since when. Apart from
-- outbox.queue_level, whose rows the sweeps then never update: an Enqueue's probe of a
-- level waits for no sweep, and a producer's REPEATABLE READ insert meets no new version.
CREATE TABLE outbox.queue_level_idle (
    tenant_id text NOT NULL,
    kind text NOT NULL,
    priority smallint NOT NULL,
    since timestamptz NOT NULL,
    PRIMARY KEY (tenant_id, kind, priority)
);

ALTER TABLE outbox.queue_level_idle ENABLE ROW LEVEL SECURITY;
ALTER TABLE outbox.queue_level_idle FORCE ROW LEVEL SECURITY;
CREATE POLICY queue_level_idle_of_current_tenants ON outbox.queue_level_idle
    USING (tenant_id = ANY ((SELECT v.tenants FROM outbox.verified_tenants v)::text[]))
    WITH CHECK (tenant_id = ANY ((SELECT v.tenants FROM outbox.verified_tenants v)::text[]));
CREATE POLICY queue_level_idle_fleet ON outbox.queue_level_idle TO outboxd_fleet
    USING (true) WITH CHECK (true);

-- The sweep's look for live intents of a level outside the claimable index and the leases':
-- staged, waiting, and those an operator must decide on. Not for PENDING, LEASED or
-- SUBMITTED rows, so that no claim, Ack or direct unordered Enqueue writes an entry here.
-- Built in this migration's transaction: writes to outbox.intent wait for the build, a
-- scan of the table (docs/decisions.md, "Empty queues are forgotten after an hour").
CREATE INDEX intent_level_parked_idx ON outbox.intent (level_key)
    WHERE state IN ('staged', 'waiting', 'needs_reconcile', 'dead_lettered');

-- Only the fleet sweeps (store::forget_empty_queues).
GRANT SELECT, INSERT, UPDATE, DELETE ON outbox.queue_level_idle TO outboxd_fleet;
GRANT DELETE ON outbox.queue_level TO outboxd_fleet;

-- The queue's advisory lock key (one bigint; the prefix keeps it apart from outboxd's other
-- advisory locks): one of 16 per tenant, which its queues share, so that an Enqueue of a
-- thousand kinds holds 16 locks, not a thousand, in PostgreSQL's shared lock table.
CREATE FUNCTION outbox.queue_lock_key(tenant_id text, kind text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT hashtextextended('outbox.queue/' || tenant_id, hashtext(kind) & 15) $$;

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

SELECT outbox.regrant_service_roles();
