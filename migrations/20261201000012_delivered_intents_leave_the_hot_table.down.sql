DROP FUNCTION outbox.ack_into_history(text, text, uuid[], uuid[], timestamptz);

-- The delivered history goes back where the previous release looks for it, with every
-- tenant's rows (the owner is subject to the policies too).
SELECT set_config('outbox.cross_tenant', 'on', true);
INSERT INTO outbox.intent SELECT * FROM outbox.intent_history;

DROP VIEW outbox.all_intents;
DROP TABLE outbox.intent_history;

CREATE OR REPLACE FUNCTION outbox.grant_service_role(role_name text) RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    EXECUTE format('GRANT USAGE ON SCHEMA outbox TO %I', role_name);
    EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON outbox.intent, outbox.resolution TO %I', role_name);
    EXECUTE format('GRANT USAGE ON ALL SEQUENCES IN SCHEMA outbox TO %I', role_name);
    EXECUTE format('GRANT SELECT ON outbox.api_key TO %I', role_name);
    EXECUTE format('GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA outbox TO %I', role_name);
END;
$$;
