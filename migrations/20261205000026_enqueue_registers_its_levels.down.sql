-- …09's trigger: every insert into outbox.intent registers its levels.

DROP TRIGGER intent_registers_queue_levels ON outbox.intent;

CREATE TRIGGER intent_registers_queue_levels
    AFTER INSERT ON outbox.intent
    REFERENCING NEW TABLE AS new_intents
    FOR EACH STATEMENT EXECUTE FUNCTION outbox.register_queue_levels();
