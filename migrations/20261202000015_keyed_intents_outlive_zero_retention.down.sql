-- Back to migration 20261201000010's outbox.ack_and_delete (with 0013's settings): it
-- deletes keyed intents too.
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
