-- Raw-SQL ceiling of Enqueue: one transaction inserting :batch PENDING intents (direct
-- mode) into outbox.intent with the tenant scope set as src/outbox/store/access.rs does.
-- Simpler than outboxd's statement (src/outbox/store/enqueue.rs): no idempotency keys, so
-- no ON CONFLICT probe and no join back; ids are generated server-side, random UUIDs
-- whose first 48 bits are the statement's Unix milliseconds, as outboxd's UUIDv7 ids: the
-- Ack files delivered intents by those bits (outbox.history_bucket), so random v4 ids
-- would make every delivered intent a history row of its own.
-- Variables: -D batch=N.
BEGIN;
SELECT set_config('outbox.tenants', 'bench', true), set_config('outbox.cross_tenant', 'off', true);
INSERT INTO outbox.intent (id, tenant_id, kind, region, payload, content_type, headers,
                           state, max_attempts, available_at, created_at, updated_at, level_key)
SELECT encode(overlay(uuid_send(gen_random_uuid())
               PLACING substring(int8send((extract(epoch FROM now()) * 1000)::bigint) FROM 3)
               FROM 1 FOR 6), 'hex')::uuid,
       'bench', 'bench.throughput', '',
       convert_to('{"n":' || g || ',"pad":"' || repeat('x', 48) || '"}', 'UTF8'),
       'application/json', '{}', 'pending', 5, now(), now(), now(),
       hashtextextended('bench/bench.throughput', 0)
FROM generate_series(1, :batch) AS g;
COMMIT;
