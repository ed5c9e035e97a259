DROP FUNCTION outbox.fail(text, text, uuid[], uuid[], text[], text[], bigint[], float8, float8, timestamptz);
