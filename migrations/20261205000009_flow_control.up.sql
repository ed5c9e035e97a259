-- Flow control (docs/flow-control.md): priorities, queues and their policies, and a claim
-- that walks the queues instead of one index over every tenant's PENDING intents.
--
-- A queue is a (tenant, kind); a level is a queue's intents of one priority. Claims walk
-- the levels registered in outbox.queue_level (a row per level ever used, written by the
-- insert trigger below), take each level oldest first through the claimable index, and
-- share a batch among tenants, then among a tenant's kinds. A queue's policy
-- (outbox.queue_policy: paused, a concurrency limit, a token-bucket rate) is read and,
-- when it limits, locked by the claim that takes from it, so that it holds across replicas.

ALTER TABLE outbox.intent
    ADD COLUMN priority smallint NOT NULL DEFAULT 0,
    ADD CONSTRAINT intent_priority_in_range CHECK (priority BETWEEN -10 AND 10);

-- Every level that ever held an intent. Never emptied by outboxd: kinds are few (a kind per
-- entity belongs in ordering_key or a header, see docs/flow-control.md).
CREATE TABLE outbox.queue_level (
    tenant_id text NOT NULL,
    kind text NOT NULL,
    priority smallint NOT NULL,
    level_key bigint GENERATED ALWAYS AS (hashtextextended(tenant_id || '/' || kind, priority)) STORED,
    PRIMARY KEY (tenant_id, kind, priority)
);

-- One row per queue an operator gave a policy; none: no limit, not paused.
CREATE TABLE outbox.queue_policy (
    tenant_id text NOT NULL,
    kind text NOT NULL,
    paused boolean NOT NULL DEFAULT false,
    -- At most this many intents LEASED or SUBMITTED at once (NULL: no limit).
    max_in_flight int CHECK (max_in_flight >= 1),
    -- At most this many leases per second, up to `burst` at once (NULL: no limit).
    rate_per_second float8 CHECK (rate_per_second > 0 AND rate_per_second <= 1000000),
    burst int CHECK (burst >= 1),
    -- The bucket: tokens left as of tokens_at (NULL: full).
    tokens float8,
    tokens_at timestamptz,
    updated_by text NOT NULL,
    reason text NOT NULL,
    updated_at timestamptz NOT NULL,
    PRIMARY KEY (tenant_id, kind),
    CONSTRAINT queue_policy_rate_has_burst CHECK ((rate_per_second IS NULL) = (burst IS NULL))
);

-- Every change of a policy: who, when, why, and the policy it set. Kept.
CREATE TABLE outbox.queue_policy_change (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id text NOT NULL,
    kind text NOT NULL,
    paused boolean NOT NULL,
    max_in_flight int,
    rate_per_second float8,
    burst int,
    actor text NOT NULL,
    reason text NOT NULL,
    changed_at timestamptz NOT NULL
);

CREATE INDEX queue_policy_change_queue_idx ON outbox.queue_policy_change (tenant_id, kind, id);

DO $$
DECLARE
    t text;
BEGIN
    FOREACH t IN ARRAY ARRAY['queue_level', 'queue_policy', 'queue_policy_change'] LOOP
        EXECUTE format('ALTER TABLE outbox.%I ENABLE ROW LEVEL SECURITY', t);
        EXECUTE format('ALTER TABLE outbox.%I FORCE ROW LEVEL SECURITY', t);
        EXECUTE format($p$CREATE POLICY %I ON outbox.%I
            USING (tenant_id = ANY ((SELECT v.tenants FROM outbox.verified_tenants v)::text[]))
            WITH CHECK (tenant_id = ANY ((SELECT v.tenants FROM outbox.verified_tenants v)::text[]))$p$,
            t || '_of_current_tenants', t);
        EXECUTE format('CREATE POLICY %I ON outbox.%I TO outboxd_fleet USING (true) WITH CHECK (true)',
                       t || '_fleet', t);
    END LOOP;
END
$$;

-- Registers the levels of inserted intents, once per statement. ON CONFLICT DO NOTHING
-- only probes the key when the level exists (no lock, no WAL).
CREATE FUNCTION outbox.register_queue_levels() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    INSERT INTO outbox.queue_level (tenant_id, kind, priority)
    SELECT DISTINCT n.tenant_id, n.kind, n.priority FROM new_intents n
    ON CONFLICT DO NOTHING;
    RETURN NULL;
END
$$;

CREATE TRIGGER intent_registers_queue_levels
    AFTER INSERT ON outbox.intent
    REFERENCING NEW TABLE AS new_intents
    FOR EACH STATEMENT EXECUTE FUNCTION outbox.register_queue_levels();

-- A level's key in the claimable index: a hash of its tenant, kind and priority
-- (`level_key`, the same expression in outbox.intent and outbox.queue_level), not the three
-- columns, whose width made every insert 20% dearer (+58 B of WAL an intent). Two levels
-- with one hash share a range; queries test the columns too. A stored column, not an
-- expression index: under row-level security a condition on a function of a row's columns
-- is not an index condition unless the function is LEAKPROOF (which only a superuser may
-- declare), and claims scanned the whole index. Written by the inserts (enqueue*.sql), not
-- generated: a stored generated column re-forms every row written, claims and Acks too
-- (7% of an insert).
ALTER TABLE outbox.intent ADD COLUMN level_key bigint;

-- The intents already here: their level keys, and their levels registered. Row-level
-- security is lifted for these statements only (the migrating role owns the tables but
-- proves no tenant).
ALTER TABLE outbox.intent NO FORCE ROW LEVEL SECURITY;
ALTER TABLE outbox.queue_level NO FORCE ROW LEVEL SECURITY;
UPDATE outbox.intent SET level_key = hashtextextended(tenant_id || '/' || kind, priority);
INSERT INTO outbox.queue_level (tenant_id, kind, priority)
SELECT DISTINCT tenant_id, kind, priority FROM outbox.intent
ON CONFLICT DO NOTHING;
ALTER TABLE outbox.intent FORCE ROW LEVEL SECURITY;
ALTER TABLE outbox.queue_level FORCE ROW LEVEL SECURITY;
ALTER TABLE outbox.intent ALTER COLUMN level_key SET NOT NULL;

-- A claim takes a level oldest first from here; replaces …01's index over every tenant.
CREATE INDEX intent_level_claimable_idx ON outbox.intent (level_key, available_at, id)
    WHERE state = 'pending';
DROP INDEX outbox.intent_claimable_idx;

-- How many more intents a limited queue may lease at `claim_at` (at most `wanted`), with
-- its policy row locked to the end of the transaction; 0 when another claim holds it
-- (SKIP LOCKED: never a wait, so never a deadlock between claims walking in different
-- orders) or it is paused. The bucket's tokens as of `claim_at` come back too.
CREATE FUNCTION outbox.queue_allowance(
    tenant text, queue_kind text, claim_at timestamptz, wanted int,
    OUT allowance int, OUT tokens float8
)
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    pol outbox.queue_policy;
    in_flight bigint;
BEGIN
    allowance := wanted;
    SELECT * INTO pol FROM outbox.queue_policy p
    WHERE p.tenant_id = tenant AND p.kind = queue_kind
    FOR UPDATE SKIP LOCKED;
    IF NOT FOUND OR pol.paused THEN
        allowance := 0;
        RETURN;
    END IF;
    IF pol.max_in_flight IS NOT NULL THEN
        -- The lease test is always true of a live lease: it lets the lease index serve.
        SELECT count(*) INTO in_flight FROM outbox.intent i
        WHERE i.state IN ('leased', 'submitted') AND i.lease_expires_at IS NOT NULL
          AND i.tenant_id = tenant AND i.kind = queue_kind;
        allowance := least(allowance, greatest(pol.max_in_flight - in_flight, 0));
    END IF;
    IF pol.rate_per_second IS NOT NULL THEN
        tokens := least(pol.burst::float8,
                        coalesce(pol.tokens, pol.burst)
                        + pol.rate_per_second
                          * greatest(extract(epoch FROM claim_at - coalesce(pol.tokens_at, claim_at)), 0));
        allowance := least(allowance, floor(tokens)::int);
    END IF;
END
$$;

-- Leases up to `max_intents` claimable intents of the worker's region (or none) and `kinds`
-- (empty: any); see src/outbox/store/claim.rs for the arguments. A replay (a `request_id`
-- that already leased for this worker) returns those live leases, as before.
--
-- The batch is shared: a first pass gives each tenant with claimable work an equal part of
-- what is left, and each of its queues an equal part of the tenant's; a second pass fills
-- what is still left from the queues that had more. Within a queue, higher priorities
-- first, each level oldest available_at first.
--
-- Each level is looked at from its floor (the arrays `floor_*`, one entry per level; none:
-- the whole level), for the reason …02_baseline_functions gives: while the xmin horizon is
-- pinned, the entries of every intent claimed since stay in the index.
--
-- `max_bytes` is a budget over the whole batch, as before: a level's take stops once the
-- intents before the next weigh it (always at least one intent).
--
-- Each take picks and locks a level's oldest rows into an array of ctids, then leases
-- them by ctid (a direct tuple fetch; …02 says why the plan is shaped so).
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
    floor_tenants text[],
    floor_kinds text[],
    floor_priorities smallint[],
    floor_ats timestamptz[],
    max_bytes bigint
) RETURNS SETOF outbox.intent
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
DECLARE
    claim_at timestamptz := coalesce(as_of, now());
    budget bigint := greatest(coalesce(max_bytes, 9223372036854775807), 1);
    salt text := random()::text;
    remaining int := max_intents;
    spent bigint := 0;
    cut boolean := false;
    q record;
    pass int;
    tenants_left bigint;
    current_tenant text;
    tenant_quota int;
    kinds_left bigint;
    wanted int;
    tokens_now float8;
    level smallint;
    level_floor timestamptz;
    allowed int;
    took int;
    picked tid[];
    taken_count int;
    taken_weight bigint;
    refused int := 0;
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
    FOR pass IN 1..2 LOOP
        EXIT WHEN remaining <= 0 OR spent >= budget OR (pass = 2 AND NOT cut);
        current_tenant := NULL;
        tenants_left := NULL;
        -- The queues to walk: its kinds (empty: any) of the scope's tenants, not paused;
        -- each with its levels highest priority first, their keys and floors (the arrays'
        -- entry, or -infinity), whether a policy limits it, its tenant's number of such
        -- queues and the number of tenants; tenant by tenant, in an order drawn afresh.
        FOR q IN
            SELECT w.tenant_id, w.kind, w.priorities, w.level_keys, w.floors, w.limited, w.tenant_kinds,
                   max(w.tenant_rank) OVER () AS tenants
            FROM (
                SELECT l.tenant_id, l.kind,
                       array_agg(l.priority ORDER BY l.priority DESC) AS priorities,
                       array_agg(l.level_key ORDER BY l.priority DESC) AS level_keys,
                       array_agg(coalesce(f.at, '-infinity') ORDER BY l.priority DESC) AS floors,
                       bool_or(p.max_in_flight IS NOT NULL OR p.rate_per_second IS NOT NULL) AS limited,
                       count(*) OVER (PARTITION BY l.tenant_id) AS tenant_kinds,
                       dense_rank() OVER (ORDER BY hashtext(l.tenant_id || salt), l.tenant_id)
                           AS tenant_rank
                FROM outbox.queue_level l
                LEFT JOIN outbox.queue_policy p ON p.tenant_id = l.tenant_id AND p.kind = l.kind
                LEFT JOIN LATERAL (
                    SELECT max(u.at) AS at
                    FROM unnest(floor_tenants, floor_kinds, floor_priorities, floor_ats)
                        AS u (tenant_id, kind, priority, at)
                    WHERE u.tenant_id = l.tenant_id AND u.kind = l.kind AND u.priority = l.priority
                ) f ON true
                WHERE (cardinality(kinds) = 0 OR l.kind = ANY (kinds))
                  AND NOT coalesce(p.paused, false)
                GROUP BY l.tenant_id, l.kind
            ) w
            ORDER BY w.tenant_rank, hashtext(w.kind || salt), w.kind
        LOOP
            IF pass = 1 THEN
                tenants_left := coalesce(tenants_left, q.tenants);
                IF q.tenant_id IS DISTINCT FROM current_tenant THEN
                    current_tenant := q.tenant_id;
                    -- At least 1: a tenant may have appeared since the count.
                    tenant_quota := ceil(remaining::numeric / greatest(tenants_left, 1));
                    tenants_left := tenants_left - 1;
                    kinds_left := q.tenant_kinds;
                END IF;
                wanted := least(remaining, ceil(tenant_quota::numeric / kinds_left)::int);
                kinds_left := kinds_left - 1;
            ELSE
                wanted := remaining;
            END IF;
            CONTINUE WHEN wanted <= 0;
            tokens_now := NULL;
            IF q.limited THEN
                SELECT a.allowance, a.tokens INTO allowed, tokens_now
                FROM outbox.queue_allowance(q.tenant_id, q.kind, claim_at, wanted) a;
                -- Leases the limit refused to a claim that wanted them while the queue had
                -- due intents (for outbox_leases_refused_by_limit_total).
                FOR k IN 1..cardinality(q.priorities) LOOP
                    EXIT WHEN allowed >= wanted;
                    IF EXISTS (
                        SELECT 1 FROM outbox.intent p
                        WHERE p.state = 'pending'
                          AND p.level_key = q.level_keys[k]
                          AND p.tenant_id = q.tenant_id AND p.kind = q.kind
                          AND p.priority = q.priorities[k]
                          AND p.available_at <= claim_at
                    ) THEN
                        refused := refused + (wanted - allowed);
                        EXIT;
                    END IF;
                END LOOP;
                wanted := allowed;
                CONTINUE WHEN wanted <= 0;
            END IF;
            took := 0;
            FOR n IN 1..cardinality(q.priorities) LOOP
                EXIT WHEN took >= wanted OR spent >= budget;
                level := q.priorities[n];
                level_floor := q.floors[n];
                -- Picked and locked, then leased by ctid: no row is copied twice, and the
                -- weight taken is the last running total.
                SELECT coalesce(array_agg(c.ctid), '{}'), coalesce(max(c.through), 0)
                INTO picked, taken_weight
                FROM (
                    SELECT p.ctid, p.weight,
                           sum(p.weight) OVER (ORDER BY p.available_at, p.id
                                               ROWS UNBOUNDED PRECEDING) AS through
                    FROM (
                        SELECT p.ctid, p.available_at, p.id,
                               outbox.reply_weight(p.payload, p.headers, p.last_error) AS weight
                        FROM outbox.intent p
                        WHERE p.state = 'pending'
                          AND p.level_key = q.level_keys[n]
                          AND p.tenant_id = q.tenant_id
                          AND p.kind = q.kind
                          AND p.priority = level
                          AND p.available_at <= claim_at
                          AND p.available_at >= level_floor
                          AND (worker_region = '' OR p.region = '' OR p.region = worker_region)
                        ORDER BY p.available_at, p.id
                        LIMIT wanted - took
                        FOR UPDATE SKIP LOCKED
                    ) p
                ) c
                WHERE c.through - c.weight < budget - spent;
                CONTINUE WHEN cardinality(picked) = 0;
                RETURN QUERY
                    UPDATE outbox.intent i
                    SET state = 'leased',
                        attempts = i.attempts + 1,
                        lease_id = gen_random_uuid(),
                        lease_expires_at = claim_at + lease_ms * interval '1 ms',
                        worker_id = worker,
                        claim_request_id = request_id,
                        updated_at = claim_at
                    WHERE i.ctid = ANY (picked)
                    RETURNING i.*;
                GET DIAGNOSTICS taken_count = ROW_COUNT;
                took := took + taken_count;
                spent := spent + taken_weight;
            END LOOP;
            IF took > 0 AND tokens_now IS NOT NULL THEN
                -- Never back in time: a claim whose transaction began before the last
                -- one's refilled nothing, and must not have the next refill that span again.
                UPDATE outbox.queue_policy p
                SET tokens = tokens_now - took,
                    tokens_at = greatest(coalesce(p.tokens_at, claim_at), claim_at)
                WHERE p.tenant_id = q.tenant_id AND p.kind = q.kind;
            END IF;
            remaining := remaining - took;
            IF pass = 1 THEN
                tenant_quota := tenant_quota - took;
                cut := cut OR (took >= wanted);
            END IF;
            EXIT WHEN remaining <= 0 OR spent >= budget;
        END LOOP;
    END LOOP;
    IF refused > 0 THEN
        PERFORM set_config('outbox.refused_by_limit', refused::text, true);
    END IF;
END
$$;

DROP FUNCTION outbox.claim(text, text, text, text, text[], int, bigint, text, timestamptz,
                           timestamptz, bigint);

-- Seconds until a claim with these filters could lease again, when that is in the future:
-- the next PENDING intent of a queue it walks becomes due, or a rate-limited queue with
-- due intents gets its next token. A long-polling claimer that found nothing sleeps that
-- long. (A queue at its concurrency limit frees up when a lease ends: not a time.)
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
        SELECT min(due.seconds)
        FROM outbox.queue_level l
        LEFT JOIN outbox.queue_policy p ON p.tenant_id = l.tenant_id AND p.kind = l.kind
        CROSS JOIN LATERAL (
            (SELECT extract(epoch FROM n.available_at - look_at)::float8 AS seconds
             FROM outbox.intent n
             WHERE n.state = 'pending'
               AND n.level_key = l.level_key
               AND n.tenant_id = l.tenant_id AND n.kind = l.kind AND n.priority = l.priority
               AND n.available_at > look_at
               AND (worker_region = '' OR n.region = '' OR n.region = worker_region)
             ORDER BY n.available_at
             LIMIT 1)
            UNION ALL
            SELECT (1 - (coalesce(p.tokens, p.burst)
                         + p.rate_per_second
                           * greatest(extract(epoch FROM look_at - coalesce(p.tokens_at, look_at)), 0)))
                   / p.rate_per_second
            WHERE p.rate_per_second IS NOT NULL
              AND EXISTS (
                  SELECT 1 FROM outbox.intent n
                  WHERE n.state = 'pending'
                    AND n.level_key = l.level_key
                    AND n.tenant_id = l.tenant_id AND n.kind = l.kind
                    AND n.priority = l.priority
                    AND n.available_at <= look_at
                    AND (worker_region = '' OR n.region = '' OR n.region = worker_region))
        ) due
        WHERE (cardinality(kinds) = 0 OR l.kind = ANY (kinds))
          AND NOT coalesce(p.paused, false)
          AND due.seconds > 0
    );
END
$$;

-- The oldest due PENDING intent of the scope's tenants (of `regions`, empty: any), found
-- level by level through the claimable index: for GetQueueStats and the queue gauges.
CREATE FUNCTION outbox.oldest_pending(as_of timestamptz, regions text[])
RETURNS timestamptz
LANGUAGE sql STABLE
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
    SELECT min(o.available_at)
    FROM outbox.queue_level l
    CROSS JOIN LATERAL (
        SELECT n.available_at
        FROM outbox.intent n
        WHERE n.state = 'pending'
          AND n.level_key = l.level_key
          AND n.tenant_id = l.tenant_id AND n.kind = l.kind AND n.priority = l.priority
          AND n.available_at <= coalesce(as_of, now())
          AND (cardinality(regions) = 0 OR n.region = '' OR n.region = ANY (regions))
        ORDER BY n.available_at
        LIMIT 1
    ) o
$$;

-- The history's items have no ordering key and priority 0 (…06 added the key's columns).
CREATE OR REPLACE FUNCTION outbox.intents_by_id(wanted_ids uuid[]) RETURNS SETOF outbox.intent
LANGUAGE sql STABLE
AS $$
    SELECT * FROM outbox.intent i WHERE i.id = ANY (wanted_ids)
    UNION ALL
    SELECT x.*, NULL::text, NULL::timestamptz, NULL::bigint, 0::smallint, NULL::bigint
    FROM outbox.delivered_batch b
    CROSS JOIN LATERAL unnest(b.items) x
    WHERE b.bucket = ANY ((
            SELECT array_agg(DISTINCT outbox.history_bucket(w)) FROM unnest(wanted_ids) w
          )::bigint[])
      AND (cardinality(wanted_ids) > 16 OR b.ids && wanted_ids)
      AND x.id IN (SELECT unnest(wanted_ids))
$$;

CREATE OR REPLACE VIEW outbox.all_intents WITH (security_invoker = true) AS
    SELECT * FROM outbox.intent
    UNION ALL
    SELECT x.*, NULL::text, NULL::timestamptz, NULL::bigint, 0::smallint, NULL::bigint
    FROM outbox.delivered_batch b CROSS JOIN LATERAL unnest(b.items) x;

-- The service role reads and writes the new tables (…03's grant, with them).
CREATE OR REPLACE FUNCTION outbox.grant_service_role(role_name text) RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    EXECUTE format('GRANT USAGE ON SCHEMA outbox TO %I', role_name);
    EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON outbox.intent, outbox.resolution TO %I', role_name);
    EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON outbox.delivered_batch TO %I', role_name);
    EXECUTE format('GRANT SELECT, INSERT, UPDATE ON outbox.queue_level, outbox.queue_policy, outbox.queue_policy_change TO %I', role_name);
    EXECUTE format('GRANT SELECT ON outbox.all_intents TO %I', role_name);
    EXECUTE format('GRANT USAGE ON ALL SEQUENCES IN SCHEMA outbox TO %I', role_name);
    EXECUTE format('GRANT SELECT ON outbox.api_key TO %I', role_name);
    EXECUTE format('GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA outbox TO %I', role_name);
END;
$$;

SELECT outbox.regrant_service_roles();
