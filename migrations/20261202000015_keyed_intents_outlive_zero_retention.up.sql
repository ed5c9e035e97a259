-- At retention zero an Ack deleted every intent it delivered, keyed ones too, and with the
-- row went the key: a producer that retried an Enqueue whose answer it had lost, after a
-- worker had already delivered the intent, recorded it again, and the side effect ran
-- twice. Now outbox.ack_and_delete deletes only intents without an idempotency key; a
-- keyed one is marked DELIVERED in place (outbox.ack, as at any other retention), where
-- the unique index on its key still guards it, and the purge deletes it once its key's
-- window (OUTBOX_RETENTION__IDEMPOTENCY_KEYS) is over. Intents without a key are deleted
-- by the Ack as before. Otherwise the body of migration 20261201000010, with the settings
-- migration 20261201000013 gave it. During a rolling upgrade, servers of the previous
-- release purge with the finished retention alone: at retention zero they delete keyed
-- DELIVERED intents at their next sweep, until they are replaced.
CREATE OR REPLACE FUNCTION outbox.ack_and_delete(
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
SET enable_hashjoin = on
SET enable_mergejoin = off
SET enable_nestloop = off
AS $$
#variable_conflict use_column
DECLARE
    deleted bigint;
BEGIN
    PERFORM outbox.enter_scope(tenants, cross_tenant);
    RETURN QUERY
        DELETE FROM outbox.intent i
        USING unnest(intent_ids, lease_ids) AS input(id, lease_id)
        WHERE i.id = ANY (intent_ids)
          AND i.id = input.id
          AND i.lease_id = input.lease_id
          AND i.state IN ('leased', 'submitted', 'needs_reconcile')
          AND i.idempotency_key IS NULL
        RETURNING i.id, 'delivered'::outbox.intent_state, NULL::timestamptz,
                  i.headers->>'traceparent';
    GET DIAGNOSTICS deleted = ROW_COUNT;
    IF deleted < cardinality(intent_ids) THEN
        -- What is left (keyed intents, lost leases, replays) is outbox.ack's: in place.
        RETURN QUERY
            SELECT * FROM outbox.ack(tenants, cross_tenant, intent_ids, lease_ids, as_of);
    END IF;
END
$$;
