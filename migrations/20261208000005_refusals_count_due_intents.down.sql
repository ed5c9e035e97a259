-- Undoes …05_refusals_count_due_intents: the claim of …04 again.

CREATE OR REPLACE FUNCTION outbox.claim(
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
    -- The scope is part of the digest: a retry under another scope (a narrower tenant
    -- header, a key's tenants changed) is a claim of its own, never a row its scope
    -- may not see.
    request_key text := outbox.claim_request_digest(worker, tenants || '/' || request_id);
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
    refusing text[] := '{}';
    picked_ids uuid[];
    weights bigint[];
    kept int;
    waited boolean;
    leased_ids uuid[] := '{}';
    replay_ids uuid[];
    turn_at timestamptz;
BEGIN
    PERFORM outbox.enter_scope(tenants, scope_proof);
    IF request_id IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(hashtextextended(worker || '/' || request_id, 0));
        SELECT r.intent_ids INTO replay_ids
        FROM outbox.claim_request r
        WHERE r.digest = request_key;
        IF replay_ids IS NOT NULL THEN
            RETURN QUERY
                SELECT *
                FROM outbox.intent i
                WHERE i.id = ANY (replay_ids)
                  AND i.worker_id = worker
                  AND i.claim_request_id = request_key
                  AND i.state IN ('leased', 'submitted')
                  -- Still held: one past its expiry may be rescued and leased to another
                  -- worker at any moment (the rescue, which takes leases that expired
                  -- before now, had not come yet). None left: a claim of its own.
                  AND i.lease_expires_at >= claim_at
                  AND (worker_region = '' OR i.region = '' OR i.region = worker_region)
                  AND (cardinality(kinds) = 0 OR i.kind = ANY (kinds));
            IF FOUND THEN
                RETURN;
            END IF;
        END IF;
    END IF;
    FOR pass IN 1..2 LOOP
        EXIT WHEN remaining <= 0 OR spent >= budget OR (pass = 2 AND NOT cut);
        current_tenant := NULL;
        tenants_left := NULL;
        waited := false;
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
                SELECT a.allowance, a.tokens, a.claim_at INTO allowed, tokens_now, turn_at
                FROM outbox.queue_allowance(q.tenant_id, q.kind, claim_at, as_of IS NULL,
                                            wanted) a;
                waited := true;
                IF turn_at > claim_at THEN
                    -- Leases count from the turn: the rest of this claim's, and, after a wait
                    -- longer than a worker's margin (the SDKs count a lease from its answer
                    -- less at least 250 ms), those it took before it (their rows; the answer
                    -- may say the earlier expiry). A new row version each: not for the
                    -- milliseconds of an ordinary turn.
                    IF remaining < max_intents AND turn_at > claim_at + interval '100 ms' THEN
                        UPDATE outbox.intent i
                        SET lease_expires_at = turn_at + lease_ms * interval '1 ms',
                            updated_at = turn_at
                        WHERE i.state = 'leased'
                          AND i.lease_expires_at = claim_at + lease_ms * interval '1 ms'
                          AND i.worker_id = worker;
                    END IF;
                    claim_at := turn_at;
                END IF;
                -- Leases the limit refused to a claim that wanted them while the queue had
                -- due intents (for outbox_leases_refused_by_limit_total), counted once a
                -- queue: not again when the second pass comes back to it.
                FOR k IN 1..cardinality(q.priorities) LOOP
                    EXIT WHEN allowed >= wanted OR q.tenant_id || '/' || q.kind = ANY (refusing);
                    IF EXISTS (
                        SELECT 1 FROM outbox.intent p
                        WHERE p.state = 'pending'
                          AND p.level_key = q.level_keys[k]
                          AND p.tenant_id = q.tenant_id AND p.kind = q.kind
                          AND p.priority = q.priorities[k]
                          AND p.available_at <= claim_at
                    ) THEN
                        refused := refused + (wanted - allowed);
                        refusing := refusing || (q.tenant_id || '/' || q.kind);
                        EXIT;
                    END IF;
                END LOOP;
                wanted := allowed;
                CONTINUE WHEN wanted <= 0;
            -- The walk read the policies when it began; when this claim may have waited
            -- since (for a limited queue's turn), a pause or a limit set meanwhile holds from
            -- here.
            ELSIF waited THEN
                CONTINUE WHEN EXISTS (
                    SELECT 1 FROM outbox.queue_policy p
                    WHERE p.tenant_id = q.tenant_id AND p.kind = q.kind
                      AND (p.paused OR p.max_in_flight IS NOT NULL
                           OR p.rate_per_second IS NOT NULL)
                );
            END IF;
            took := 0;
            FOR n IN 1..cardinality(q.priorities) LOOP
                EXIT WHEN took >= wanted OR spent >= budget;
                level := q.priorities[n];
                level_floor := q.floors[n];
                -- Picked and locked, then leased by ctid: no row is copied twice. The rows
                -- come in the index's order (oldest first), and so do the aggregates.
                SELECT coalesce(array_agg(p.ctid), '{}'), coalesce(array_agg(p.id), '{}'),
                       coalesce(array_agg(p.weight), '{}'), coalesce(sum(p.weight), 0)
                INTO picked, picked_ids, weights, taken_weight
                FROM (
                    SELECT p.ctid, p.id,
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
                ) p;
                IF taken_weight > budget - spent THEN
                    -- Past the reply's budget: keep the oldest while what comes before them
                    -- fits (at least one). The rest stay locked, unchanged, to the commit.
                    kept := 0;
                    taken_weight := 0;
                    WHILE kept < cardinality(weights) AND taken_weight < budget - spent LOOP
                        kept := kept + 1;
                        taken_weight := taken_weight + weights[kept];
                    END LOOP;
                    picked := picked[1:kept];
                    picked_ids := picked_ids[1:kept];
                END IF;
                CONTINUE WHEN cardinality(picked) = 0;
                RETURN QUERY
                    UPDATE outbox.intent i
                    SET state = 'leased',
                        attempts = i.attempts + 1,
                        lease_id = gen_random_uuid(),
                        lease_expires_at = claim_at + lease_ms * interval '1 ms',
                        worker_id = worker,
                        claim_request_id = request_key,
                        updated_at = claim_at
                    WHERE i.ctid = ANY (picked)
                    RETURNING i.*;
                GET DIAGNOSTICS taken_count = ROW_COUNT;
                took := took + taken_count;
                IF request_id IS NOT NULL THEN
                    leased_ids := leased_ids || picked_ids;
                END IF;
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
    IF cardinality(leased_ids) > 0 THEN
        INSERT INTO outbox.claim_request AS r (digest, scope_tenants, intent_ids, expires_at)
        VALUES (request_key, coalesce(string_to_array(nullif(tenants, ''), ','), '{}'),
                leased_ids, claim_at + lease_ms * interval '1 ms')
        -- A retry that leased anew (its kinds or region took none of the first attempt's
        -- leases) keeps the first attempt's ids too: a later retry may still want them.
        ON CONFLICT (digest) DO UPDATE
        SET intent_ids = r.intent_ids || excluded.intent_ids,
            expires_at = greatest(r.expires_at, excluded.expires_at);
    END IF;
    IF refused > 0 THEN
        PERFORM set_config('outbox.refused_by_limit', refused::text, true);
    END IF;
END
$$;
