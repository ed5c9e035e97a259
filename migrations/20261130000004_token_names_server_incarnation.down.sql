CREATE OR REPLACE FUNCTION outbox.txn_token() RETURNS text
LANGUAGE plpgsql
VOLATILE
AS $$
DECLARE
    token text;
BEGIN
    SELECT 'v1.' || system_identifier || '.' || pg_current_xact_id()
    INTO token
    FROM pg_control_system();
    PERFORM pg_notify('outbox_txn_committed', '');
    RETURN token;
END;
$$;

DROP FUNCTION IF EXISTS outbox.server_incarnation();
DROP FUNCTION IF EXISTS outbox.xact_status(xid8);
