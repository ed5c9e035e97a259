-- Settles join their batch by hash. Ack, Fail, ExtendLease and MarkSubmitted join the
-- batch (`unnest(intent_ids, lease_ids, …)`) to the intents it names, which they read by
-- primary key (`i.id = ANY (intent_ids)`, migration 20261201000009), with only nested
-- loops allowed. The planner put the primary-key scan outside and the batch inside, and
-- matched each intent against every item: n² comparisons. An Ack of 1,000 intents (the
-- default largest batch) spent 240 of its 246 ms there ("Rows Removed by Join Filter:
-- 999000", auto_explain); at batches of 100 it did not show. A hash join of the same two
-- inputs is linear (the Ack of 1,000: 18 ms) and reads the intents by primary key as
-- before, on a tiny table as on a large one (checked with auto_explain on both). Burn-down
-- through gRPC at batches of 1,000: 25k → 33k intents/s, at retention zero 30k → 46k.
-- Merge joins stay off (they would sort the batch for nothing), and so do sequential and
-- bitmap scans.
ALTER FUNCTION outbox.ack(text, text, uuid[], uuid[], timestamptz)
    SET enable_hashjoin = on
    SET enable_nestloop = off;
ALTER FUNCTION outbox.ack_and_delete(text, text, uuid[], uuid[], timestamptz)
    SET enable_hashjoin = on
    SET enable_nestloop = off;
ALTER FUNCTION outbox.ack_into_history(text, text, uuid[], uuid[], timestamptz)
    SET enable_hashjoin = on
    SET enable_nestloop = off;
ALTER FUNCTION outbox.extend_leases(text, text, uuid[], uuid[], bigint, timestamptz)
    SET enable_hashjoin = on
    SET enable_nestloop = off;
ALTER FUNCTION outbox.mark_submitted(text, text, uuid[], uuid[], timestamptz)
    SET enable_hashjoin = on
    SET enable_nestloop = off;
ALTER FUNCTION outbox.fail(text, text, uuid[], uuid[], text[], text[], bigint[], float8, float8, timestamptz)
    SET enable_hashjoin = on
    SET enable_nestloop = off;
