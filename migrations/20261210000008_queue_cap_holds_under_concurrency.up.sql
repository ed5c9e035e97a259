-- A tenant's cap of 1,000 queues holds when statements register new queues at once. The
-- cap trigger counted the committed levels and its own, so concurrent statements each
-- found room: six Enqueues of 1,000 new kinds each left 3,000 levels. Now a statement that
-- adds a level takes its tenant's lock before it counts, to the end of its transaction:
-- the next one counts after that commit (READ COMMITTED takes the count's snapshot after
-- the lock). Only new levels take it (the trigger fires for rows inserted, not for the
-- known levels each Enqueue probes). outboxd's Enqueue commits right after its statement;
-- an application's own transaction inserting intents of new kinds holds the lock to its
-- commit (another such transaction may then end in a deadlock error, to retry), and under
-- REPEATABLE READ counts with its older snapshot (flow-control.md). The two-key form keeps
-- the lock apart from every one-key advisory lock of outboxd's.

CREATE OR REPLACE FUNCTION outbox.queues_within_their_cap() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('outbox.queue_cap'), hashtext(NEW.tenant_id));
    IF (SELECT count(*) FROM outbox.queue_level l WHERE l.tenant_id = NEW.tenant_id) > 1000 THEN
        RAISE EXCEPTION 'tenant % would have more than 1000 queues (kinds × priorities)',
            NEW.tenant_id
            USING ERRCODE = 'OBX01';
    END IF;
    RETURN NULL;
END
$$;
