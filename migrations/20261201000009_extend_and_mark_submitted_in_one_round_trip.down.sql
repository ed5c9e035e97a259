DROP FUNCTION outbox.mark_submitted(text, text, uuid[], uuid[], timestamptz);
DROP FUNCTION outbox.extend_leases(text, text, uuid[], uuid[], bigint, timestamptz);

-- Marks the leased intents DELIVERED: `intent_ids[k]` under lease `lease_ids[k]`, from the
-- live lease (LEASED, SUBMITTED, even expired but not yet rescued) or from the last lease
-- of a NEEDS_RECONCILE intent. Returns the intents it changed; the caller matches them to
-- its items. Planned once per connection, as a nested loop of primary-key lookups over the
-- batch: planning it per call cost more than running it (0.56 of 0.74 ms a call), and a
-- plan left free to choose, made while the table was small, was a merge join over the
-- whole primary key (or, on a young table, a sequential scan) that stayed.
CREATE OR REPLACE FUNCTION outbox.ack(
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
        UPDATE outbox.intent i
        SET state = 'delivered',
            lease_expires_at = NULL,
            claim_request_id = NULL,
            finished_at = coalesce(as_of, now()),
            updated_at = coalesce(as_of, now())
        FROM unnest(intent_ids, lease_ids) AS input(id, lease_id)
        WHERE i.id = input.id
          AND i.lease_id = input.lease_id
          AND i.state IN ('leased', 'submitted', 'needs_reconcile')
        RETURNING i.id, i.state, i.lease_expires_at, i.headers->>'traceparent';
END
$$;
