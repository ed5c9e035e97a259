-- Restores …11's grants (INSERT on outbox.console_session) and drops the function.
DROP FUNCTION outbox.open_console_session(text, bytea, text, float8);

CREATE OR REPLACE FUNCTION outbox.grant_service_role(role_name text) RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    EXECUTE format('GRANT USAGE ON SCHEMA outbox TO %I', role_name);
    EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON outbox.intent, outbox.resolution TO %I', role_name);
    EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON outbox.delivered_batch TO %I', role_name);
    EXECUTE format('GRANT SELECT, INSERT, UPDATE ON outbox.queue_level, outbox.queue_policy, outbox.queue_policy_change TO %I', role_name);
    EXECUTE format('GRANT SELECT ON outbox.all_intents TO %I', role_name);
    EXECUTE format('GRANT USAGE ON ALL SEQUENCES IN SCHEMA outbox TO %I', role_name);
    EXECUTE format('GRANT SELECT ON outbox.api_key TO %I', role_name);
    EXECUTE format('GRANT SELECT, INSERT, DELETE ON outbox.console_session TO %I', role_name);
    EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON outbox.claim_tally TO %I', role_name);
    EXECUTE format('GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA outbox TO %I', role_name);
END;
$$;

SELECT outbox.regrant_service_roles();
