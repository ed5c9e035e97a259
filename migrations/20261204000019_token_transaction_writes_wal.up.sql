-- The token's transaction writes WAL, so its COMMIT is flushed (and waits for a
-- synchronous standby) like any other.
--
-- PostgreSQL flushes a commit record, and waits for synchronous standbys, only when the
-- transaction wrote WAL of its own (xact.c, RecordTransactionCommit: "wrote_xlog"). A
-- producer transaction that wrote nothing but its token (an enqueue from a read-only flow)
-- has an xid, but neither pg_current_xact_id() nor the NOTIFY writes WAL: its COMMIT was
-- acknowledged before it was durable (0.2-0.5 ms against 1.2-1.5 ms with a row). After a
-- crash, or a failover to a standby that never received it, the id read "aborted" and
-- outboxd discarded intents whose producer had been told COMMIT OK.
--
-- A transactional logical-decoding message is the smallest WAL record a transaction can
-- write without a table: it is part of the transaction (decoders see it only if it
-- commits), it needs no privilege (EXECUTE on pg_logical_emit_message is granted to
-- PUBLIC) and it works at wal_level replica (the record is written at any wal_level;
-- only decoding it needs logical). Its prefix 'outboxd' lets a logical-decoding consumer
-- (Debezium and the like, at wal_level logical) ignore it. It also writes the xid into
-- the WAL at once, so a WAL flush by anything else (the WAL writer, another commit) keeps
-- recovery from handing the id out again.
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
    PERFORM pg_logical_emit_message(true, 'outboxd', '');
    PERFORM pg_notify('outbox_txn_committed', '');
    RETURN token;
END;
$$;
