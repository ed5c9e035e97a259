-- Undoes …09: one claimable index and one claim over every tenant again; priorities,
-- queue levels and policies are dropped (the policy history with them).
DROP TRIGGER intent_registers_queue_levels ON outbox.intent;
DROP FUNCTION outbox.register_queue_levels();
DROP FUNCTION outbox.claim(text, text, text, text, text[], int, bigint, text, timestamptz,
                           text[], text[], smallint[], timestamptz[], bigint);
DROP FUNCTION outbox.queue_allowance(text, text, timestamptz, int);
DROP FUNCTION outbox.oldest_pending(timestamptz, text[]);
DROP VIEW outbox.all_intents;

CREATE INDEX intent_claimable_idx ON outbox.intent (available_at, id)
    WHERE state = 'pending';
DROP INDEX outbox.intent_level_claimable_idx;
DROP TABLE outbox.queue_policy_change;
DROP TABLE outbox.queue_policy;
DROP TABLE outbox.queue_level;
ALTER TABLE outbox.intent DROP COLUMN level_key, DROP COLUMN priority;

-- As …02_baseline_functions defined them.
CREATE FUNCTION outbox.claim(
    tenants text,
    scope_proof text,
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
    -- Bounds as variables, so that they bound the index scan (see the top of this file).
    claim_at timestamptz := coalesce(as_of, now());
    claim_from timestamptz := coalesce(look_back_to, '-infinity');
    budget bigint := greatest(coalesce(max_bytes, 9223372036854775807), 1);
BEGIN
    PERFORM outbox.enter_scope(tenants, scope_proof);
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


CREATE OR REPLACE FUNCTION outbox.next_due_in(
    tenants text,
    scope_proof text,
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
    PERFORM outbox.enter_scope(tenants, scope_proof);
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

-- As …06 defined them.
CREATE OR REPLACE FUNCTION outbox.intents_by_id(wanted_ids uuid[]) RETURNS SETOF outbox.intent
LANGUAGE sql STABLE
AS $$
    SELECT * FROM outbox.intent i WHERE i.id = ANY (wanted_ids)
    UNION ALL
    SELECT x.*, NULL::text, NULL::timestamptz, NULL::bigint
    FROM outbox.delivered_batch b
    CROSS JOIN LATERAL unnest(b.items) x
    WHERE b.bucket = ANY ((
            SELECT array_agg(DISTINCT outbox.history_bucket(w)) FROM unnest(wanted_ids) w
          )::bigint[])
      AND (cardinality(wanted_ids) > 16 OR b.ids && wanted_ids)
      AND x.id IN (SELECT unnest(wanted_ids))
$$;

CREATE VIEW outbox.all_intents WITH (security_invoker = true) AS
    SELECT * FROM outbox.intent
    UNION ALL
    SELECT x.*, NULL::text, NULL::timestamptz, NULL::bigint
    FROM outbox.delivered_batch b CROSS JOIN LATERAL unnest(b.items) x;

-- As …03_baseline_tenancy defined it.
CREATE OR REPLACE FUNCTION outbox.grant_service_role(role_name text) RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    EXECUTE format('GRANT USAGE ON SCHEMA outbox TO %I', role_name);
    EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON outbox.intent, outbox.resolution TO %I', role_name);
    EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON outbox.delivered_batch TO %I', role_name);
    EXECUTE format('GRANT SELECT ON outbox.all_intents TO %I', role_name);
    EXECUTE format('GRANT USAGE ON ALL SEQUENCES IN SCHEMA outbox TO %I', role_name);
    EXECUTE format('GRANT SELECT ON outbox.api_key TO %I', role_name);
    EXECUTE format('GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA outbox TO %I', role_name);
END;
$$;

GRANT SELECT ON outbox.all_intents TO outboxd_fleet;
SELECT outbox.regrant_service_roles();
