DROP FUNCTION outbox.ack_into_batches(text, text, uuid[], uuid[], timestamptz);
DROP FUNCTION outbox.intents_by_id(uuid[]);
DROP FUNCTION outbox.regrant_service_roles();

-- The batches go back where the previous release looks for delivered intents, with every
-- tenant's rows (the owner is subject to the policies too). Locked first: an Ack of a
-- server still running this release that commits after the copy's snapshot would
-- otherwise be dropped with the table.
SELECT set_config('outbox.cross_tenant', 'on', true);
LOCK TABLE outbox.delivered_batch IN EXCLUSIVE MODE;
INSERT INTO outbox.intent_history
    SELECT x.* FROM outbox.delivered_batch b CROSS JOIN LATERAL unnest(b.items) x;

CREATE OR REPLACE VIEW outbox.all_intents WITH (security_invoker = true) AS
    SELECT * FROM outbox.intent
    UNION ALL
    SELECT * FROM outbox.intent_history;

DROP TABLE outbox.delivered_batch;
DROP FUNCTION outbox.history_bucket(uuid);
DROP TYPE outbox.delivered_intent_v1;

CREATE OR REPLACE FUNCTION outbox.grant_service_role(role_name text) RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    EXECUTE format('GRANT USAGE ON SCHEMA outbox TO %I', role_name);
    EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON outbox.intent, outbox.resolution TO %I', role_name);
    EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON outbox.intent_history TO %I', role_name);
    EXECUTE format('GRANT SELECT ON outbox.all_intents TO %I', role_name);
    EXECUTE format('GRANT USAGE ON ALL SEQUENCES IN SCHEMA outbox TO %I', role_name);
    EXECUTE format('GRANT SELECT ON outbox.api_key TO %I', role_name);
    EXECUTE format('GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA outbox TO %I', role_name);
END;
$$;
