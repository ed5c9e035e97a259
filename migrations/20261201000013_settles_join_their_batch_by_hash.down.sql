-- Back to nested loops only (migration 20261201000009's settings).
ALTER FUNCTION outbox.ack(text, text, uuid[], uuid[], timestamptz)
    SET enable_hashjoin = off
    RESET enable_nestloop;
ALTER FUNCTION outbox.ack_and_delete(text, text, uuid[], uuid[], timestamptz)
    SET enable_hashjoin = off
    RESET enable_nestloop;
ALTER FUNCTION outbox.ack_into_history(text, text, uuid[], uuid[], timestamptz)
    SET enable_hashjoin = off
    RESET enable_nestloop;
ALTER FUNCTION outbox.extend_leases(text, text, uuid[], uuid[], bigint, timestamptz)
    SET enable_hashjoin = off
    RESET enable_nestloop;
ALTER FUNCTION outbox.mark_submitted(text, text, uuid[], uuid[], timestamptz)
    SET enable_hashjoin = off
    RESET enable_nestloop;
ALTER FUNCTION outbox.fail(text, text, uuid[], uuid[], text[], text[], bigint[], float8, float8, timestamptz)
    SET enable_hashjoin = off
    RESET enable_nestloop;
