CREATE OR REPLACE FUNCTION outbox.txn_token() RETURNS text
LANGUAGE plpgsql
VOLATILE
AS $$
DECLARE
    token text;
BEGIN
    SELECT 'v2.' || system_identifier || '.' || outbox.server_incarnation() || '.'
           || pg_current_xact_id()
    INTO token
    FROM pg_control_system();
    PERFORM pg_notify('outbox_txn_committed', '');
    RETURN token;
END;
$$;
