DROP FUNCTION outbox.ack(text, text, uuid[], uuid[], timestamptz);
DROP FUNCTION outbox.next_due_in(text, text, text, text[], timestamptz);
DROP FUNCTION outbox.claim(text, text, text, text, text[], int, bigint, text, timestamptz);
DROP FUNCTION outbox.enter_scope(text, text);
