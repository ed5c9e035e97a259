-- The request-serving role inserted console sessions for any key id, so a statement
-- injected into its connection could open a session of an all-tenant admin key (every
-- key's id is readable), and through the console act for every tenant. A session is now
-- opened only by this function, given the key's secret, which no table holds (the
-- key's hash is what is stored): the role keeps SELECT (to find a session) and DELETE (to
-- end one).
CREATE FUNCTION outbox.open_console_session(
    secret text, session_hash bytea, csrf text, ttl_seconds float8
) RETURNS uuid
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    signed_in uuid;
BEGIN
    SELECT k.id INTO signed_in
    FROM outbox.api_key k
    WHERE k.key_hash = sha256(convert_to(secret, 'UTF8'))
      AND k.revoked_at IS NULL
      AND k.scopes && ARRAY['operate', 'admin']::text[];
    IF signed_in IS NULL THEN
        RETURN NULL;
    END IF;
    DELETE FROM outbox.console_session s WHERE s.expires_at < now();
    INSERT INTO outbox.console_session (token_hash, key_id, csrf_token, created_at, expires_at)
    VALUES (session_hash, signed_in, csrf, now(), now() + make_interval(secs => ttl_seconds));
    RETURN signed_in;
END
$$;

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
    EXECUTE format('REVOKE INSERT ON outbox.console_session FROM %I', role_name);
    EXECUTE format('GRANT SELECT, DELETE ON outbox.console_session TO %I', role_name);
    EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON outbox.claim_tally TO %I', role_name);
    EXECUTE format('GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA outbox TO %I', role_name);
END;
$$;

SELECT outbox.regrant_service_roles();
