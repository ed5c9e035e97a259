-- outboxd's Enqueue statements register their intents' levels themselves (a
-- data-modifying CTE of enqueue*.sql) and set `outbox.levels_registered` in their
-- transaction; the insert trigger now skips such transactions. Its transition table,
-- function call and statement of its own cost PostgreSQL ~0.05 ms an Enqueue (measured at
-- 1,000 intents a second, one per call), the CTE ~0.025. The trigger stays for every
-- other insert: an older outboxd during a rolling upgrade, SQL behind outboxd's back.

DROP TRIGGER intent_registers_queue_levels ON outbox.intent;

CREATE TRIGGER intent_registers_queue_levels
    AFTER INSERT ON outbox.intent
    REFERENCING NEW TABLE AS new_intents
    FOR EACH STATEMENT
    WHEN (current_setting('outbox.levels_registered', true) IS DISTINCT FROM 'on')
    EXECUTE FUNCTION outbox.register_queue_levels();
