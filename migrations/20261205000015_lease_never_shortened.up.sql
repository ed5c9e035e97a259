-- ExtendLease never moves a lease's expiry back. A call whose statement waited on a row
-- lock (behind a stalled transaction) kept its transaction's now(): committed after a
-- later extension of the same lease, it set the expiry seconds into the past, the rescue
-- took the intent back to PENDING, and it was leased again while its worker held a lease
-- the server had just extended (the fault suite's NoOverlappingLeases, seed
-- 11220680508070879144).
--
-- The function is …02's but for the greatest().
CREATE OR REPLACE FUNCTION outbox.extend_leases(
    tenants text,
    scope_proof text,
    intent_ids uuid[],
    lease_ids uuid[],
    lease_ms bigint,
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
    PERFORM outbox.enter_scope(tenants, scope_proof);
    RETURN QUERY
        UPDATE outbox.intent i
        SET lease_expires_at = greatest(i.lease_expires_at,
                                        coalesce(as_of, now()) + lease_ms * interval '1 ms'),
            updated_at = coalesce(as_of, now())
        FROM unnest(intent_ids, lease_ids) AS input(id, lease_id)
        WHERE i.id = ANY (intent_ids)
          AND i.id = input.id
          AND i.lease_id = input.lease_id
          -- As text: see above on the lease-expiry index.
          AND i.state::text IN ('leased', 'submitted')
        RETURNING i.id, i.state, i.lease_expires_at, i.headers->>'traceparent';
END
$$;
