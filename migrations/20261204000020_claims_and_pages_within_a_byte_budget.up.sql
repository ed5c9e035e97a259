-- A Claim and a ListIntents page stop at a byte budget inside the statement, so that the
-- rows they will not send are never read. Before, a Claim of max_intents = 1000 over
-- intents of 1 MiB leased and returned all 1000 (1 GB read into the server, +2.5 GB of
-- peak memory, 7-22 s) for the server to send 3 and give the rest back; a ListIntents page
-- of 1000 read every payload, even without include_payload.
--
-- outbox.reply_weight is what an intent adds to a reply, near enough: its large parts
-- (payload, headers, last error) and 512 bytes for the rest, bounded by the name limits.
-- octet_length of a bytea or text reads the stored size (the TOAST pointer's for a large
-- value), never the value; pg_column_size of the headers is their stored, maybe compressed,
-- size. The server's in-memory reply budget (`split_at_reply_budget`) stays the exact guard.

CREATE FUNCTION outbox.reply_weight(payload bytea, headers jsonb, last_error text)
RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
RETURN 512 + coalesce(octet_length(payload), 0) + coalesce(pg_column_size(headers), 0)
    + coalesce(octet_length(last_error), 0);

-- The claim of migration 20261202000014 with a budget: the oldest candidates are locked
-- and taken while the weight of those before each is under max_bytes (so at least one,
-- however large; NULL: no budget). Rows past the budget are locked for the statement but
-- neither updated nor returned.
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
    look_back_to timestamptz,
    max_bytes bigint
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
    budget bigint := greatest(coalesce(max_bytes, 9223372036854775807), 1);
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
                SELECT c.ctid
                FROM (
                    SELECT p.ctid, p.weight,
                           sum(p.weight) OVER (ORDER BY p.available_at, p.id
                                               ROWS UNBOUNDED PRECEDING) AS through
                    FROM (
                        SELECT p.ctid, p.available_at, p.id,
                               outbox.reply_weight(p.payload, p.headers, p.last_error) AS weight
                        FROM outbox.intent p
                        WHERE p.state = 'pending'
                          AND p.available_at <= claim_at
                          AND p.available_at >= claim_from
                          AND (worker_region = '' OR p.region = '' OR p.region = worker_region)
                          AND (cardinality(kinds) = 0 OR p.kind = ANY (kinds))
                        ORDER BY p.available_at, p.id
                        LIMIT max_intents
                        FOR UPDATE SKIP LOCKED
                    ) p
                ) c
                WHERE c.through - c.weight < budget
            ))
        RETURNING i.*;
END
$$;

-- The previous signature, for servers of the previous release during a rolling upgrade.
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
AS $$
BEGIN
    RETURN QUERY SELECT * FROM outbox.claim(tenants, cross_tenant, worker, worker_region,
        kinds, max_intents, lease_ms, request_id, as_of, look_back_to, NULL);
END
$$;
