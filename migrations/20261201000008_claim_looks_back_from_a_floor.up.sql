-- Claim looks back from a floor: `outbox.claim` takes `look_back_to`, and leases only
-- intents available at or after it (NULL: no floor, the whole queue). The claimable
-- index keeps an entry for every version of a row that was PENDING until vacuum removes
-- it, and while a session pins the xmin horizon (an idle transaction, a long report, a
-- lagging replication slot) nothing is removed, not even marked dead: every claim walked
-- all the entries of intents claimed since the pin began, from the oldest, and claim time
-- grew without bound (7 ms at 1,000 intents/s after 30 s, rising). The server passes a
-- floor a little behind the newest intent a group of claimers took, so a claim walks only
-- those last entries, and looks at the whole queue every few seconds for intents that
-- became claimable behind the floor (src/outbox/claim_floor.rs says which, and why a
-- floor never loses one). The bodies are the previous ones (migration 20261201000007
-- says why they are shaped so) with that condition added and their time bounds computed
-- first:
--
-- Row-level security: the policies' conditions are evaluated before any condition of the
-- query that PostgreSQL cannot prove leakproof, and such a condition cannot bound an index
-- scan. `coalesce(…)` is never proved leakproof, so the previous claim's
-- `available_at <= coalesce(as_of, now())` filtered rows instead of ending the scan: every
-- claim that found fewer than its batch walked the whole claimable index, delayed intents
-- included, and next_due_in's `available_at > coalesce(…)` walked it from the start. Both
-- functions now compute their bounds into variables first (parameters, which are safe).

CREATE FUNCTION outbox.claim(
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
    -- see the note on row-level security above.
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

-- The previous signature stays, as the new function without a floor: servers of the
-- previous release keep claiming while a rolling upgrade replaces them.
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
LANGUAGE sql VOLATILE
AS $$
    SELECT * FROM outbox.claim(tenants, cross_tenant, worker, worker_region, kinds,
                               max_intents, lease_ms, request_id, as_of, NULL)
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
DECLARE
    look_at timestamptz := coalesce(as_of, now());
BEGIN
    PERFORM outbox.enter_scope(tenants, cross_tenant);
    RETURN (
        SELECT extract(epoch FROM p.available_at - look_at)::float8
        FROM outbox.intent p
        WHERE p.state = 'pending'
          AND p.available_at > look_at
          AND (worker_region = '' OR p.region = '' OR p.region = worker_region)
          AND (cardinality(kinds) = 0 OR p.kind = ANY (kinds))
        ORDER BY p.available_at
        LIMIT 1
    );
END
$$;
