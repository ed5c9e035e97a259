-- The purge finds finished intents through the primary key instead of an index of its
-- own. intent_finished_at_idx took an entry for every intent Ack delivered (and every
-- STAGED one discarded), one of the two index entries of the ack's new row version, to be
-- read once, by the purge, a retention later: dropping it lifted the raw-SQL burn-down
-- ceiling 11-12% in pgbench (24.6k/26.9k -> 27.3k/30.2k intents/s).
--
-- Ids are UUIDv7, minted by outboxd at Enqueue: their first 48 bits are the creation time
-- in milliseconds, so every intent created before an instant sorts below
-- outbox.uuid_v7_floor(that instant), and an intent finished before the purge's cutoff was
-- created before it. The purge walks the primary key up to the cutoff (plus a minute for
-- the skew between outboxd's clock, which mints the ids, and PostgreSQL's), skipping what
-- is not purgeable yet: live intents and operator queues older than the retention, and
-- intents that finished after it.
--
-- During a rolling upgrade the previous release's purge, which orders by finished_at,
-- reads the table instead of that index until its servers are replaced.

-- The smallest UUIDv7 of instant `t`: its millisecond timestamp, every other bit zero.
CREATE FUNCTION outbox.uuid_v7_floor(t timestamptz) RETURNS uuid
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
    SELECT (lpad(to_hex(greatest(floor(extract(epoch FROM t) * 1000), 0)::bigint), 12, '0')
            || '00000000000000000000')::uuid
$$;

DROP INDEX outbox.intent_finished_at_idx;
