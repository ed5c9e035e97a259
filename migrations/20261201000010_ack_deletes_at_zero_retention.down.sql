DROP FUNCTION outbox.ack_and_delete(text, text, uuid[], uuid[], timestamptz);
