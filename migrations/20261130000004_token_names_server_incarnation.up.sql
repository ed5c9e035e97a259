-- Tokens v2: v2.<system identifier>.<server incarnation>.<transaction id>.
--
-- PostgreSQL does not WAL-log handing out a transaction id. A transaction that took its
-- token but wrote nothing that reached disk before a crash leaves no trace, and crash
-- recovery hands the same id to the next transaction that asks (so does a restore to a
-- point in time, or a standby promoted after a failover). A v1 token retried after such a
-- crash named a stranger's transaction. The incarnation tells the server lives apart:
-- outboxd compares it with its own and never stages intents on a token from an earlier
-- life (the transaction it named cannot be open any more).
--
-- The incarnation is when the cluster's shared statistics were last reset, in
-- microseconds since 1970: PostgreSQL discards them after every crash recovery (also a
-- crash of one backend, which restarts all of them but not the postmaster, so the
-- postmaster's start time would not do) and on restore, and keeps them across clean
-- restarts. LEAST over two kinds: an operator resetting one kind alone
-- (pg_stat_reset_shared('bgwriter')) leaves it unchanged. Producers in other databases of
-- the cluster inline the same expression (README).
CREATE FUNCTION outbox.server_incarnation() RETURNS bigint
LANGUAGE sql
STABLE
AS $$
    SELECT (extract(epoch FROM least(pg_stat_get_bgwriter_stat_reset_time(),
                                     (SELECT stats_reset FROM pg_stat_archiver)))
            * 1000000)::bigint
$$;

COMMENT ON FUNCTION outbox.server_incarnation() IS
    'Changes whenever PostgreSQL recovers from a crash or a restore: the lifetime a two-phase token belongs to';

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

-- pg_xact_status, but 'future' for an id not handed out yet instead of an error (which
-- would abort outboxd's transaction: it checks the token in the transaction that stages
-- the intents) and 'forgotten' for one too old to look up.
CREATE FUNCTION outbox.xact_status(xid xid8) RETURNS text
LANGUAGE plpgsql
STABLE
AS $$
BEGIN
    RETURN coalesce(pg_xact_status(xid), 'forgotten');
EXCEPTION WHEN invalid_parameter_value THEN
    RETURN 'future';
END;
$$;
