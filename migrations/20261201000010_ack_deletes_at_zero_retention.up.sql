-- With a retention of zero a delivered intent is purged as soon as the purge next runs,
-- so keeping its row until then buys nothing: outboxd acks by deleting it instead. Marking
-- a row DELIVERED writes a new row version and an entry in every index it stays in (the
-- primary key, the purge's finished_at index, the idempotency key's), which the purge
-- then deletes again; a DELETE only marks the row. In pgbench, with outboxd's claim, the
-- claim-and-ack loop's ceiling rose from 27-31k to 43.5k intents/s.
--
-- Same contract as outbox.ack (migration 20261201000009): `intent_ids[k]` under lease
-- `lease_ids[k]`, from a live lease or the last lease of a NEEDS_RECONCILE intent; returns
-- the intents it delivered (state DELIVERED, as the row was when it went), planned once per
-- connection as primary-key lookups over the batch.
CREATE FUNCTION outbox.ack_and_delete(
    tenants text,
    cross_tenant text,
    intent_ids uuid[],
    lease_ids uuid[],
    as_of timestamptz
) RETURNS TABLE (
    id uuid,
    state outbox.intent_state,
    lease_expires_at timestamptz,
    traceparent text
)
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
#variable_conflict use_column
BEGIN
    PERFORM outbox.enter_scope(tenants, cross_tenant);
    RETURN QUERY
        DELETE FROM outbox.intent i
        USING unnest(intent_ids, lease_ids) AS input(id, lease_id)
        WHERE i.id = ANY (intent_ids)
          AND i.id = input.id
          AND i.lease_id = input.lease_id
          AND i.state IN ('leased', 'submitted', 'needs_reconcile')
        RETURNING i.id, 'delivered'::outbox.intent_state, NULL::timestamptz,
                  i.headers->>'traceparent';
END
$$;
