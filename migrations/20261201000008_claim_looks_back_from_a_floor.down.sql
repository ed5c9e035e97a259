DROP FUNCTION outbox.claim(text, text, text, text, text[], int, bigint, text, timestamptz, timestamptz);

CREATE OR REPLACE FUNCTION outbox.claim(
    tenants text,
    cross_tenant text,
    worker text,
    worker_region text,
    kinds text[],
    max_intents int,
    lease_ms bigint,
    request_id text,
    as_of timestamptz
) RETURNS SETOF outbox.intent
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
BEGIN
    PERFORM outbox.enter_scope(tenants, cross_tenant);
    IF request_id IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(hashtextextended(worker || '/' || request_id, 0));
        RETURN QUERY
            SELECT *
            FROM outbox.intent i
            WHERE i.worker_id = worker
              AND i.claim_request_id = request_id
              AND i.state IN ('leased', 'submitted');
        IF FOUND THEN
            RETURN;
        END IF;
    END IF;
    RETURN QUERY
        UPDATE outbox.intent i
        SET state = 'leased',
            attempts = i.attempts + 1,
            lease_id = gen_random_uuid(),
            lease_expires_at = coalesce(as_of, now()) + lease_ms * interval '1 ms',
            worker_id = worker,
            claim_request_id = request_id,
            updated_at = coalesce(as_of, now())
        WHERE i.ctid = ANY (ARRAY(
                SELECT p.ctid
                FROM outbox.intent p
                WHERE p.state = 'pending'
                  AND p.available_at <= coalesce(as_of, now())
                  AND (worker_region = '' OR p.region = '' OR p.region = worker_region)
                  AND (cardinality(kinds) = 0 OR p.kind = ANY (kinds))
                ORDER BY p.available_at, p.id
                LIMIT max_intents
                FOR UPDATE SKIP LOCKED
            ))
        RETURNING i.*;
END
$$;

-- Seconds until the next PENDING intent matching a claim's filters becomes due, if one is
-- scheduled in the future: a long-polling claimer that found nothing sleeps that long.
CREATE OR REPLACE FUNCTION outbox.next_due_in(
    tenants text,
    cross_tenant text,
    worker_region text,
    kinds text[],
    as_of timestamptz
) RETURNS float8
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
BEGIN
    PERFORM outbox.enter_scope(tenants, cross_tenant);
    RETURN (
        SELECT extract(epoch FROM p.available_at - coalesce(as_of, now()))::float8
        FROM outbox.intent p
        WHERE p.state = 'pending'
          AND p.available_at > coalesce(as_of, now())
          AND (worker_region = '' OR p.region = '' OR p.region = worker_region)
          AND (cardinality(kinds) = 0 OR p.kind = ANY (kinds))
        ORDER BY p.available_at
        LIMIT 1
    );
END
$$;
