-- Undoes …07_empty_queues_are_forgotten: the trigger function as …02_baseline_functions
-- wrote it.
CREATE OR REPLACE FUNCTION outbox.register_queue_levels() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    INSERT INTO outbox.queue_level (tenant_id, kind, priority)
    SELECT DISTINCT n.tenant_id, n.kind, n.priority FROM new_intents n
    ON CONFLICT DO NOTHING;
    RETURN NULL;
END
$$;

DROP INDEX outbox.intent_level_parked_idx;
DROP FUNCTION outbox.queue_lock_key(text, text);
REVOKE DELETE ON outbox.queue_level FROM outboxd_fleet;
DROP TABLE outbox.queue_level_idle;
