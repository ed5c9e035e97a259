-- Fail as Ack, ExtendLease and MarkSubmitted are (migrations 20261201000007 and 0009): one
-- statement in its own implicit transaction, scoped for row-level security, planned once
-- per connection as primary-key lookups over the batch. It was three round trips (BEGIN
-- with the scope, the statement, COMMIT) planned per call, and Fail is what a worker calls
-- for every intent while its target is down.
--
-- `intent_ids[k]` under lease `lease_ids[k]` failed with `outcomes[k]` ('retry',
-- 'permanent' or 'unknown'), `errors[k]` and, for a retry, `retry_after_ms[k]` (NULL: the
-- backoff, `least(cap_ms, base_ms * 2^(attempts - 1))` with jitter). RETRY → PENDING after
-- it, or DEAD_LETTERED when attempts are used up; PERMANENT → DEAD_LETTERED; UNKNOWN →
-- NEEDS_RECONCILE. Accepted from a live lease, and a definite outcome (RETRY, PERMANENT)
-- also from the last lease of a NEEDS_RECONCILE intent. Returns the intents it changed.
CREATE FUNCTION outbox.fail(
    tenants text,
    cross_tenant text,
    intent_ids uuid[],
    lease_ids uuid[],
    outcomes text[],
    errors text[],
    retry_after_ms bigint[],
    base_ms float8,
    cap_ms float8,
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
DECLARE
    -- A variable, not an expression in the query: see migration 0008 on row-level security.
    failed_at timestamptz := coalesce(as_of, now());
BEGIN
    PERFORM outbox.enter_scope(tenants, cross_tenant);
    RETURN QUERY
        UPDATE outbox.intent i
        SET state = CASE
                WHEN input.outcome = 'unknown' THEN 'needs_reconcile'
                WHEN input.outcome = 'permanent' THEN 'dead_lettered'
                WHEN i.attempts >= i.max_attempts THEN 'dead_lettered'
                ELSE 'pending'
            END::outbox.intent_state,
            available_at = CASE
                WHEN input.outcome = 'retry' THEN failed_at
                    + coalesce(
                        input.retry_after_ms,
                        least(cap_ms, base_ms * power(2, least(greatest(i.attempts - 1, 0), 40)))
                            * (0.5 + random() / 2)
                    ) * interval '1 ms'
                ELSE i.available_at
            END,
            lease_expires_at = NULL,
            claim_request_id = NULL,
            last_error = input.error,
            updated_at = failed_at
        FROM unnest(intent_ids, lease_ids, outcomes, errors, retry_after_ms)
            AS input(id, lease_id, outcome, error, retry_after_ms)
        WHERE i.id = ANY (intent_ids)
          AND i.id = input.id
          AND i.lease_id = input.lease_id
          AND (i.state IN ('leased', 'submitted')
               OR (i.state = 'needs_reconcile' AND input.outcome <> 'unknown'))
        RETURNING i.id, i.state, i.lease_expires_at, i.headers->>'traceparent';
END
$$;
