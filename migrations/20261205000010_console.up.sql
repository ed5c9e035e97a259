-- The operator console (docs/console.md): its sign-ins.

-- A console sign-in. The cookie carries a random secret; only its SHA-256 is stored (as
-- for API keys). A session lives no longer than its key: the lookup joins the live key,
-- so revoking a key ends its sessions at once.
CREATE TABLE outbox.console_session (
    token_hash bytea PRIMARY KEY,
    key_id uuid NOT NULL REFERENCES outbox.api_key (id) ON DELETE CASCADE,
    -- The token every form of the session carries (CSRF).
    csrf_token text NOT NULL,
    created_at timestamptz NOT NULL,
    expires_at timestamptz NOT NULL
);

-- Sign-ins remove expired sessions.
CREATE INDEX console_session_expires_at_idx ON outbox.console_session (expires_at);

-- The service role writes sign-ins (never keys: the console mints and revokes them through
-- the owner's connection, see docs/console.md).
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
    EXECUTE format('GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA outbox TO %I', role_name);
END;
$$;

SELECT outbox.regrant_service_roles();
