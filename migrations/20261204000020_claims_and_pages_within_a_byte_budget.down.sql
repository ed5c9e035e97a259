-- Back to the claim of migration 20261202000014, with no byte budget.

DROP FUNCTION outbox.claim(text, text, text, text, text[], int, bigint, text, timestamptz, timestamptz, bigint);

CREATE OR REPLACE FUNCTION outbox.claim(
    tenants text,
    cross_tenant text,
    worker text,
    worker_region text,
    kinds text[],
    max_intents int,
    lease_ms bigint,
    request_id text,
    as_of timestamptz,
    look_back_to timestamptz
) RETURNS SETOF outbox.intent
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
DECLARE
    -- The bounds as variables (parameters to the planner), not as expressions in the query:
    -- see the note on row-level security in migration 20261201000008.
    claim_at timestamptz := coalesce(as_of, now());
    claim_from timestamptz := coalesce(look_back_to, '-infinity');
BEGIN
    PERFORM outbox.enter_scope(tenants, cross_tenant);
    IF request_id IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(hashtextextended(worker || '/' || request_id, 0));
        RETURN QUERY
            SELECT *
            FROM outbox.intent i
            WHERE i.worker_id = worker
              AND i.claim_request_id = request_id
              AND i.state IN ('leased', 'submitted')
              AND (worker_region = '' OR i.region = '' OR i.region = worker_region)
              AND (cardinality(kinds) = 0 OR i.kind = ANY (kinds));
        IF FOUND THEN
            RETURN;
        END IF;
    END IF;
    RETURN QUERY
        UPDATE outbox.intent i
        SET state = 'leased',
            attempts = i.attempts + 1,
            lease_id = gen_random_uuid(),
            lease_expires_at = claim_at + lease_ms * interval '1 ms',
            worker_id = worker,
            claim_request_id = request_id,
            updated_at = claim_at
        WHERE i.ctid = ANY (ARRAY(
                SELECT p.ctid
                FROM outbox.intent p
                WHERE p.state = 'pending'
                  AND p.available_at <= claim_at
                  AND p.available_at >= claim_from
                  AND (worker_region = '' OR p.region = '' OR p.region = worker_region)
                  AND (cardinality(kinds) = 0 OR p.kind = ANY (kinds))
                ORDER BY p.available_at, p.id
                LIMIT max_intents
                FOR UPDATE SKIP LOCKED
            ))
        RETURNING i.*;
END
$$;

DROP FUNCTION outbox.reply_weight(bytea, jsonb, text);
