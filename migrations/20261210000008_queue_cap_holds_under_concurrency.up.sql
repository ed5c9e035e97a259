-- A tenant's cap of 1,000 queues holds when Enqueues register new queues at once. The cap
-- trigger counted the committed levels and its own, so concurrent statements each found
-- room: six Enqueues of 1,000 new kinds each left 3,000 levels. Now a statement that adds
-- a level takes its tenant's lock before it counts, to its commit: the next one counts
-- after it. Only new levels take it (the trigger fires for rows inserted, not for the
-- known levels each Enqueue probes); outboxd registers them in one-statement
-- transactions, so the lock is held for one statement.

CREATE OR REPLACE FUNCTION outbox.queues_within_their_cap() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended('outbox.queue_cap/' || NEW.tenant_id, 0));
    IF (SELECT count(*) FROM outbox.queue_level l WHERE l.tenant_id = NEW.tenant_id) > 1000 THEN
        RAISE EXCEPTION 'tenant % would have more than 1000 queues (kinds × priorities)',
            NEW.tenant_id
            USING ERRCODE = 'OBX01';
    END IF;
    RETURN NULL;
END
$$;
