-- Phase 1 of the two-phase token: called inside the producer's open transaction, it names
-- the cluster and the transaction. pg_current_xact_id() assigns the transaction an id if it
-- had none, so the token always names a real transaction.
--
-- The NOTIFY is transactional: PostgreSQL delivers it only if the producer commits, which
-- is exactly when outboxd should promote the staged intents at once instead of waiting for
-- its polling sweep. (Producers in other databases of the cluster build the same token
-- with plain SQL and rely on the sweep; see README.)
CREATE FUNCTION outbox.txn_token() RETURNS text
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

COMMENT ON FUNCTION outbox.txn_token() IS
    'Two-phase token naming the current transaction, for outboxd Enqueue(txn_token)';
