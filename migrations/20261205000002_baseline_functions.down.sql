-- Undoes …02_baseline_functions.
DROP FUNCTION outbox.intents_by_id(uuid[]);
DROP FUNCTION outbox.history_bucket(uuid);
DROP FUNCTION outbox.settleable_in_regions(text, text, uuid[], text[]);
DROP FUNCTION outbox.fail(text, text, uuid[], uuid[], text[], text[], bigint[], float8, float8, timestamptz);
DROP FUNCTION outbox.mark_submitted(text, text, uuid[], uuid[], timestamptz);
DROP FUNCTION outbox.extend_leases(text, text, uuid[], uuid[], bigint, timestamptz);
DROP FUNCTION outbox.ack_and_delete(text, text, uuid[], uuid[], timestamptz);
DROP FUNCTION outbox.ack_into_batches(text, text, uuid[], uuid[], timestamptz);
DROP FUNCTION outbox.ack(text, text, uuid[], uuid[], timestamptz);
DROP FUNCTION outbox.next_due_in(text, text, text, text[], timestamptz);
DROP FUNCTION outbox.claim(text, text, text, text, text[], int, bigint, text, timestamptz, timestamptz, bigint);
DROP FUNCTION outbox.reply_weight(bytea, jsonb, text);
DROP FUNCTION outbox.xact_status(xid8);
DROP FUNCTION outbox.txn_token();
DROP FUNCTION outbox.server_incarnation();
