-- The outbox's functions and its insert trigger: the two-phase token, the hot-path
-- statements as PL/pgSQL functions, flow control, ordering keys and the readers of the
-- history. The scope and grant functions are in …03_baseline_tenancy (outbox.enter_scope,
-- which the functions below call first, among them).
--
-- One round trip each. Claim, its long-poll next_due_in, Ack, Fail, ExtendLease and
-- MarkSubmitted each run as one statement in its own implicit transaction: one round trip
-- to PostgreSQL instead of three (BEGIN with the tenant scope, the statement, COMMIT). At
-- a steady 1000 intents/s round trips, not the statements, were most of PostgreSQL's CPU.
-- The reply still comes only after the commit: PostgreSQL answers the Sync that ends the
-- call once the implicit transaction has committed.
--
-- Each takes the caller's tenants and their proof first (`tenants`, `scope_proof`; the
-- fleet's scope passes '' for both), scopes its transaction with them as outboxd's BEGIN
-- does (outbox.enter_scope), and runs as its caller (SECURITY INVOKER), so row-level
-- security applies to it as to any statement.
-- Plan settings are the function's SET clauses: in force while it plans and runs,
-- restored after.
--
-- Cached plans. These functions are planned once per connection (plan_cache_mode =
-- force_generic_plan, index scans only): planning per call cost more than running (Ack:
-- 0.56 of 0.74 ms). A cached plan is made on whatever table the connection first sees, so
-- every lookup has an index condition that holds for any statistics (`i.id = ANY (ids)`):
-- a plan made on a tiny table (a new deployment) otherwise joined the batch to a full scan
-- of the primary key, and kept doing so after the table grew.
--
-- Row-level security. The policies' conditions are evaluated before any condition of the
-- query that PostgreSQL cannot prove leakproof, and such a condition cannot bound an index
-- scan. `coalesce(…)` is never proved leakproof, so a bound written
-- `available_at <= coalesce(as_of, now())` filters rows instead of ending the scan (a claim
-- that found fewer than its batch walked the whole claimable index). Time bounds are
-- therefore computed into PL/pgSQL variables first, which reach the planner as parameters.

-- ---------------------------------------------------------------------------------------
-- Two-phase tokens
-- ---------------------------------------------------------------------------------------

-- The token is v2.<system identifier>.<server incarnation>.<transaction id>. PostgreSQL
-- does not WAL-log handing out a transaction id: a transaction that took its token but
-- wrote nothing that reached disk before a crash leaves no trace, and crash recovery hands
-- the same id to the next transaction that asks (so does a restore to a point in time, or
-- a standby promoted after a failover). The incarnation tells the server lives apart:
-- outboxd compares it with its own and never stages intents on a token from an earlier
-- life.
--
-- The incarnation is when the cluster's shared statistics were last reset, in microseconds
-- since 1970: PostgreSQL discards them after every crash recovery (also a crash of one
-- backend, which restarts all of them but not the postmaster, so the postmaster's start
-- time would not do) and on restore, and keeps them across clean restarts. LEAST over two
-- kinds: an operator resetting one kind alone (pg_stat_reset_shared('bgwriter')) leaves it
-- unchanged. Producers in other databases of the cluster inline the same expression
-- (docs/producers.md).
CREATE FUNCTION outbox.server_incarnation() RETURNS bigint
LANGUAGE sql
STABLE
AS $$
    SELECT (extract(epoch FROM least(pg_stat_get_bgwriter_stat_reset_time(),
                                     (SELECT stats_reset FROM pg_stat_archiver)))
            * 1000000)::bigint
$$;

COMMENT ON FUNCTION outbox.server_incarnation() IS
    'Changes whenever PostgreSQL recovers from a crash or a restore: the lifetime a two-phase token belongs to';

-- Phase 1 of the two-phase token: called inside the producer's open transaction, it names
-- the cluster, its incarnation and the transaction. pg_current_xact_id() assigns the
-- transaction an id if it had none, so the token always names a real transaction.
--
-- The logical-decoding message makes the transaction write WAL, so that its COMMIT is
-- flushed (and waits for a synchronous standby) like any other: PostgreSQL does both only
-- for a transaction that wrote WAL of its own, and neither pg_current_xact_id() nor the
-- NOTIFY does. A producer transaction that wrote nothing but its token was acknowledged
-- before it was durable, and after a crash or a failover its id read "aborted". The
-- message is the smallest WAL record a transaction can write without a table: part of the
-- transaction (decoders see it only if it commits), no privilege needed, any wal_level;
-- its prefix 'outboxd' lets a logical-decoding consumer (Debezium and the like) ignore it.
--
-- The NOTIFY is transactional: PostgreSQL delivers it only if the producer commits, which
-- is exactly when outboxd should promote the staged intents at once instead of waiting
-- for its polling sweep.
CREATE FUNCTION outbox.txn_token() RETURNS text
LANGUAGE plpgsql
VOLATILE
AS $$
DECLARE
    token text;
BEGIN
    SELECT 'v2.' || system_identifier || '.' || outbox.server_incarnation() || '.'
           || pg_current_xact_id()
    INTO token
    FROM pg_control_system();
    PERFORM pg_logical_emit_message(true, 'outboxd', '');
    PERFORM pg_notify('outbox_txn_committed', '');
    RETURN token;
END;
$$;

COMMENT ON FUNCTION outbox.txn_token() IS
    'Two-phase token naming the current transaction, for outboxd Enqueue(txn_token)';

-- pg_xact_status, but 'future' for an id not handed out yet instead of an error (which
-- would abort outboxd's transaction: it checks the token in the transaction that stages
-- the intents) and 'forgotten' for one too old to look up.
CREATE FUNCTION outbox.xact_status(xid xid8) RETURNS text
LANGUAGE plpgsql
STABLE
AS $$
BEGIN
    RETURN coalesce(pg_xact_status(xid), 'forgotten');
EXCEPTION WHEN invalid_parameter_value THEN
    RETURN 'future';
END;
$$;

-- ---------------------------------------------------------------------------------------
-- Small helpers
-- ---------------------------------------------------------------------------------------

-- What an intent adds to a reply, near enough: its large parts (payload, headers, last
-- error) and 512 bytes for the rest, bounded by the name limits. A Claim and a ListIntents
-- page stop at a byte budget inside the statement, so that the rows they will not send are
-- never read (a Claim of 1000 intents of 1 MiB read 1 GB to send 3). octet_length of a
-- bytea or text reads the stored size (the TOAST pointer's for a large value), never the
-- value; pg_column_size of the headers is their stored, maybe compressed, size. The
-- server's in-memory reply budget (`split_at_reply_budget`) stays the exact guard.
CREATE FUNCTION outbox.reply_weight(payload bytea, headers jsonb, last_error text)
RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE
RETURN 512 + coalesce(octet_length(payload), 0) + coalesce(pg_column_size(headers), 0)
    + coalesce(octet_length(last_error), 0);

-- The bucket of an intent id in outbox.delivered_batch: its first 48 bits (a UUIDv7's Unix
-- milliseconds) / 100. Any id has one, so a lookup never fails for a non-v7 id; it only
-- finds nothing.
CREATE FUNCTION outbox.history_bucket(id uuid) RETURNS bigint
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $$
    SELECT ('x' || encode(substring(uuid_send(id) FROM 1 FOR 6), 'hex'))::bit(48)::bigint / 100
$$;

-- The digest a claim with a request id keeps on the intents it leased and as the key of its
-- outbox.claim_request row: 96 bits of SHA-256 (24 hex digits) of the worker and what the
-- claim passes as `request_id` (its scope's tenants and its request id), so that a key
-- cannot make another key's digest.
CREATE FUNCTION outbox.claim_request_digest(worker text, request_id text) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
RETURN left(encode(sha256(convert_to(worker || '/' || request_id, 'UTF8')), 'hex'), 24);

-- ---------------------------------------------------------------------------------------
-- Queue levels and flow control (docs/flow-control.md)
-- ---------------------------------------------------------------------------------------

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

-- outboxd's Enqueue statements register their intents' levels themselves (a data-modifying
-- CTE of enqueue*.sql) and set `outbox.levels_registered` in their transaction, which the
-- trigger skips: its transition table, function call and statement of its own cost
-- PostgreSQL ~0.05 ms an Enqueue (measured at 1,000 intents a second, one per call), the
-- CTE ~0.025. The trigger is for every other insert (SQL behind outboxd's back).
CREATE TRIGGER intent_registers_queue_levels
    AFTER INSERT ON outbox.intent
    REFERENCING NEW TABLE AS new_intents
    FOR EACH STATEMENT
    WHEN (current_setting('outbox.levels_registered', true) IS DISTINCT FROM 'on')
    EXECUTE FUNCTION outbox.register_queue_levels();

-- A tenant's queues (kinds × priorities) are few: every Claim walks the queues of its
-- scope, so a producer inventing kinds would slow every Claim of its tenant, and the
-- fleet's. A new queue past 1,000 for its tenant fails the statement that brought it
-- (SQLSTATE OBX01: RESOURCE_EXHAUSTED, TOO_MANY_QUEUES). Fired for new rows only (ON
-- CONFLICT DO NOTHING fires no AFTER trigger for a queue already there).
CREATE FUNCTION outbox.queues_within_their_cap() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    IF (SELECT count(*) FROM outbox.queue_level l WHERE l.tenant_id = NEW.tenant_id) > 1000 THEN
        RAISE EXCEPTION 'tenant % would have more than 1000 queues (kinds × priorities)',
            NEW.tenant_id
            USING ERRCODE = 'OBX01';
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER queue_level_within_its_tenants_cap
    AFTER INSERT ON outbox.queue_level
    FOR EACH ROW
    EXECUTE FUNCTION outbox.queues_within_their_cap();

-- A queue's figures, written once for the claim's allowance (outbox.queue_allowance) and
-- the policies shown to operators (store::policy): its intents in flight, and its bucket's
-- tokens at an instant.

-- Intents of a queue LEASED or SUBMITTED: what its concurrency limit counts. The lease
-- test is always true of a live lease: it lets the lease index serve. PL/pgSQL, planned
-- once per connection (a SQL function with a subquery is not inlined).
CREATE FUNCTION outbox.queue_in_flight(tenant text, queue_kind text) RETURNS bigint
LANGUAGE plpgsql STABLE
AS $$
BEGIN
    RETURN (SELECT count(*) FROM outbox.intent i
            WHERE i.state IN ('leased', 'submitted') AND i.lease_expires_at IS NOT NULL
              AND i.tenant_id = tenant AND i.kind = queue_kind);
END
$$;

-- The tokens of a policy's bucket at `at` (NULL without a rate): refilled at its rate
-- since it was last taken from, up to its burst; never refilled backwards.
CREATE FUNCTION outbox.bucket_tokens(p outbox.queue_policy, at timestamptz) RETURNS float8
LANGUAGE sql IMMUTABLE
RETURN CASE WHEN p.rate_per_second IS NOT NULL THEN
    least(p.burst::float8,
          coalesce(p.tokens, p.burst)
          + p.rate_per_second * greatest(extract(epoch FROM at - coalesce(p.tokens_at, at)), 0))
END;

-- How many more intents a limited queue may lease at `claim_at` (at most `wanted`), with
-- its policy row locked to the end of the transaction; 0 when it is paused, or when another
-- claim holds the row and this transaction already holds a policy. The bucket's tokens as
-- of `claim_at` come back too.
--
-- A claim waits for the policy row of the first limited queue it takes from, and skips
-- (SKIP LOCKED) only the limited queues after it. Skipping the first made claims of one
-- limited queue take turns: all but one came back empty and their workers slept until a
-- wake-up, though the queue had work (the limited burn-down ran at 0.62-0.66x). No
-- deadlock: a claim waits only while it holds no policy row; one that holds a policy row
-- never waits (intents and further policies are taken with SKIP LOCKED), so no claim waits
-- on a claim that waits. `outbox.holds_a_policy` marks the transaction's first lock.
--
-- The claims of one limited queue take turns on its policy row, held to each claim's
-- commit, and a commit that waited for its WAL flush (and a synchronous standby) did so
-- inside the turn. A claim that takes a policy row therefore commits without waiting; the
-- server forces the flush (a later commit that waits) before it answers, so nothing is
-- answered before it is durable, and the flushes of queued claims are shared.
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
    IF current_setting('outbox.holds_a_policy', true) = 'on' THEN
        SELECT * INTO pol FROM outbox.queue_policy p
        WHERE p.tenant_id = tenant AND p.kind = queue_kind
        FOR UPDATE SKIP LOCKED;
    ELSE
        SELECT * INTO pol FROM outbox.queue_policy p
        WHERE p.tenant_id = tenant AND p.kind = queue_kind
        FOR UPDATE;
        IF FOUND THEN
            PERFORM set_config('outbox.holds_a_policy', 'on', true);
            -- Claims of this queue wait for this row until this transaction ends: it ends
            -- without waiting for its WAL to be flushed, and the server flushes it before
            -- it answers (store::claim_intents), outside the queue's turn.
            PERFORM set_config('synchronous_commit', 'off', true);
        END IF;
    END IF;
    IF NOT FOUND OR pol.paused THEN
        allowance := 0;
        RETURN;
    END IF;
    IF pol.max_in_flight IS NOT NULL THEN
        in_flight := outbox.queue_in_flight(tenant, queue_kind);
        allowance := least(allowance, greatest(pol.max_in_flight - in_flight, 0));
    END IF;
    IF pol.rate_per_second IS NOT NULL THEN
        tokens := outbox.bucket_tokens(pol, claim_at);
        allowance := least(allowance, floor(tokens)::int);
    END IF;
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

-- ---------------------------------------------------------------------------------------
-- Claim
-- ---------------------------------------------------------------------------------------

-- Leases up to `max_intents` claimable intents of the worker's region (or none) and `kinds`
-- (empty: any); see src/outbox/store/claim.rs for the arguments.
--
-- Replays. A claim with a `request_id` writes the ids it leased to outbox.claim_request,
-- under a digest of the worker, its scope and the request id (the scope is part of it: a
-- retry under another scope, a narrower tenant header or a key whose tenants changed, is a
-- claim of its own). A retry answers those of them still leased to the worker under that
-- digest and not past their expiry (one past it may be rescued and leased to another
-- worker at any moment); none left, it claims anew. Retries of one request id are
-- serialised by an advisory lock held to the end of the transaction.
--
-- The batch is shared: a first pass gives each tenant with claimable work an equal part of
-- what is left, and each of its queues an equal part of the tenant's; a second pass fills
-- what is still left from the queues that had more. Within a queue, higher priorities
-- first, each level oldest available_at first. A limited queue's allowance is
-- outbox.queue_allowance's; the walk reads the policies when it begins, and once the claim
-- may have waited for a limited queue's turn it looks an unlimited queue's policy up again
-- before taking from it, so that a pause or a limit set meanwhile holds.
--
-- Each level is looked at from its floor (the arrays `floor_*`, one entry per level; none:
-- the whole level). The claimable index keeps an entry for every version of a row that was
-- PENDING until vacuum removes it, and while a session pins the xmin horizon nothing is
-- removed: every claim walked the entries of all intents claimed since the pin began, and
-- claim time grew without bound. The server passes floors a little behind the newest
-- intents a group of claimers took, and looks at the whole queue every few seconds
-- (src/outbox/claim/floor.rs says why a floor never loses an intent).
--
-- `max_bytes` is a budget over the whole batch (NULL: none): a level's take stops once the
-- intents before the next weigh it (always at least one intent). A take sums its rows'
-- weights, and cuts by prefix only when the sum passes what is left of the budget (rare: a
-- batch of large intents), without sorting its rows again for a running sum.
--
-- Each take picks and locks a level's oldest rows into an array of ctids, then leases them
-- by ctid: a direct tuple fetch instead of a primary-key lookup, and one plan good for
-- every batch and table size (a join of the picked rows back to the table was planned for
-- a guessed LIMIT, a tenth of the table, and a merge join over the whole primary key was
-- the generic plan of that shape). FOR UPDATE locks only rows that are PENDING (rechecked
-- on the newest version of each), and nobody can change a locked row before the UPDATE; a
-- row whose locked version is newer than the statement's snapshot is not visible at that
-- ctid and is left alone. No state test is repeated on the UPDATE on purpose: it would
-- match the claimable index's predicate, and a generic plan made on a small table walked
-- that whole index per claim.
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
                SELECT a.allowance, a.tokens INTO allowed, tokens_now
                FROM outbox.queue_allowance(q.tenant_id, q.kind, claim_at, wanted) a;
                waited := true;
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

-- Seconds until a claim with these filters could lease again, when that is in the future:
-- the next PENDING intent of a queue it walks becomes due, or a rate-limited queue with
-- due intents gets its next token. A long-polling claimer that found nothing sleeps that
-- long. (A queue at its concurrency limit frees up when a lease ends: not a time.)
CREATE FUNCTION outbox.next_due_in(
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

-- ---------------------------------------------------------------------------------------
-- Ordering keys (docs/ordering.md)
-- ---------------------------------------------------------------------------------------

-- The advisory lock of one ordering key: held by a direct Enqueue of the key until its
-- commit is visible, and by whoever advances the key. Always taken in the order of this
-- number, so that transactions taking several never wait on each other in a cycle.
CREATE FUNCTION outbox.ordering_lock(tenant text, ordering_key text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN hashtextextended('outbox.ordering_key' || chr(31) || tenant || chr(31) || ordering_key, 0);

-- When transaction `xid` committed (NULL: too old to tell).
CREATE FUNCTION outbox.commit_time(xid xid8) RETURNS timestamptz
LANGUAGE sql STABLE
RETURN pg_xact_commit_timestamp((xid::text::numeric % 4294967296)::text::xid);

-- Called before an Enqueue inserts ordered intents: false, and nothing locked, when
-- PostgreSQL does not record commit times (the caller refuses the intents); else true, the
-- keys' locks taken in lock order and held to the end of the transaction.
CREATE FUNCTION outbox.lock_ordering_keys(tenant text, ordering_keys text[]) RETURNS boolean
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    lock_id bigint;
BEGIN
    IF NOT current_setting('track_commit_timestamp')::boolean THEN
        RETURN false;
    END IF;
    FOR lock_id IN
        SELECT DISTINCT outbox.ordering_lock(tenant, k)
        FROM unnest(ordering_keys) AS k
        WHERE k IS NOT NULL
        ORDER BY 1
    LOOP
        PERFORM pg_advisory_xact_lock(lock_id);
    END LOOP;
    RETURN true;
END
$$;

-- Makes the next WAITING intent of each (tenants[k], ordering_keys[k]) PENDING where the
-- key has no head, and returns those intents: the keys' locks in lock order, then one
-- statement per step for all the keys (an Ack of 1,000 ordered intents moves 1,000 keys).
-- A key with a STAGED intent waits for that transaction to end (the promotion advances it
-- then): it may yet commit before the transactions of the WAITING ones.
--
-- Commit times order a two-phase intent among direct ones; among direct ones alone
-- insertion order is commit order (a direct Enqueue holds the key's lock until its commit
-- is visible). So a key's WAITING intents get theirs only once one of them has one (a
-- promoted two-phase intent): filled in for every key, each ordered intent was written
-- once more (a row version, index entries) when the next Enqueue or Ack of its key came.
-- Every WAITING intent of another transaction has committed, so its commit time can be
-- read; the caller's own come after them all, as its transaction commits last.
--
-- A key's rows are read by probes of each key (OFFSET 0 keeps PostgreSQL from turning them
-- into joins): as joins they were planned for the generic plan's ten keys, and the test for
-- a live head read every head of the tenant once for each key (5M rows compared for an
-- Enqueue of 1,000 keys, ~7 ms of every ordered Ack of 100 in the burn-down).
--
-- No NOTIFY: an Ack returns the intents it released as PENDING rows of its own, and the
-- server wakes claimers after the commit as it does for its Enqueues (one claimer a group,
-- the other replicas by one coalesced NOTIFY). PostgreSQL commits notifying transactions
-- one at a time (the notify queue's lock is held across the commit and its WAL flush), and
-- every waiting claim of every replica woke at each one.
CREATE FUNCTION outbox.release_keys(tenants text[], ordering_keys text[], as_of timestamptz)
RETURNS SETOF uuid
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
SET enable_bitmapscan = off
-- A key at a time through its indexes. Set here, not inherited: the Acks, which call it
-- through outbox.ack_the_rest, turn nested loops off, and under their settings this plan
-- read every head through a hash anti join over the whole primary key (3.8 s instead of
-- 0.3 ms).
SET enable_nestloop = on
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
DECLARE
    own xid8 := pg_current_xact_id_if_assigned();
    at timestamptz := coalesce(as_of, now());
    key_tenants text[];
    key_names text[];
    lock_ids bigint[];
    fill_tenants text[];
    fill_names text[];
BEGIN
    SELECT array_agg(u.tenant ORDER BY u.lock_id), array_agg(u.ordering_key ORDER BY u.lock_id),
           array_agg(u.lock_id ORDER BY u.lock_id)
    INTO key_tenants, key_names, lock_ids
    FROM (
        SELECT DISTINCT t.tenant, t.ordering_key,
               outbox.ordering_lock(t.tenant, t.ordering_key) AS lock_id
        FROM unnest(tenants, ordering_keys) AS t(tenant, ordering_key)
        WHERE t.ordering_key IS NOT NULL
    ) u;
    IF key_tenants IS NULL THEN
        RETURN;
    END IF;
    -- One statement, in the array's (lock) order.
    PERFORM pg_advisory_xact_lock(l) FROM unnest(lock_ids) AS l;

    -- Only a key whose WAITING intents include one with a commit time (a promoted
    -- two-phase intent) needs the others': direct Enqueues of a key hold its lock to
    -- their commit, so among them insertion order is commit order. The keys are chosen
    -- first, one probe each, so that the rows of the others (a million behind a blocked
    -- head, none of them filled) are never walked.
    SELECT array_agg(k.tenant), array_agg(k.ordering_key)
    INTO fill_tenants, fill_names
    FROM unnest(key_tenants, key_names) AS k(tenant, ordering_key)
    WHERE EXISTS (
        SELECT 1
        FROM outbox.intent t
        WHERE t.tenant_id = k.tenant
          AND t.ordering_key = k.ordering_key
          AND t.state = 'waiting'
          AND t.order_ts IS NOT NULL
        OFFSET 0
    );
    IF fill_names IS NOT NULL THEN
        UPDATE outbox.intent i
        SET order_ts = coalesce(outbox.commit_time(i.txn_xid), '-infinity')
        WHERE i.id IN (
            SELECT w.id
            FROM unnest(fill_tenants, fill_names) AS k(tenant, ordering_key)
            CROSS JOIN LATERAL (
                SELECT w.id
                FROM outbox.intent w
                WHERE w.tenant_id = k.tenant
                  AND w.ordering_key = k.ordering_key
                  AND w.state = 'waiting'
                  AND w.order_ts IS NULL
                  AND w.txn_xid IS DISTINCT FROM own
                OFFSET 0
            ) w
        )
          AND i.state = 'waiting'
          AND i.order_ts IS NULL;
    END IF;

    -- Claimable from now on, as a promoted STAGED intent is (outbox::claim::floor).
    RETURN QUERY
        UPDATE outbox.intent i
        SET state = 'pending',
            available_at = greatest(i.available_at, at),
            updated_at = at
        FROM (
            SELECT next.id
            FROM unnest(key_tenants, key_names) AS k(tenant, ordering_key)
            CROSS JOIN LATERAL (
                SELECT w.id
                FROM outbox.intent w
                WHERE w.tenant_id = k.tenant
                  AND w.ordering_key = k.ordering_key
                  AND w.state = 'waiting'
                ORDER BY w.order_ts, w.order_seq
                LIMIT 1
            ) next
            WHERE NOT EXISTS (
                SELECT 1
                FROM outbox.intent h
                WHERE h.tenant_id = k.tenant
                  AND h.ordering_key = k.ordering_key
                  AND h.state IN ('staged', 'pending', 'leased', 'submitted', 'needs_reconcile',
                                  'dead_lettered')
                  AND (h.state <> 'dead_lettered' OR h.finished_at IS NULL)
                OFFSET 0
            )
        ) heads
        WHERE i.id = heads.id
        RETURNING i.id;
END
$$;

-- outbox.release_keys, then a NOTIFY if it made intents PENDING: for the callers that wake
-- claimers in their transaction (promotion, operator decisions, Enqueue).
CREATE FUNCTION outbox.advance_keys(tenants text[], ordering_keys text[], as_of timestamptz)
RETURNS SETOF uuid
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    RETURN QUERY SELECT r.id FROM outbox.release_keys(tenants, ordering_keys, as_of) AS r(id);
    IF FOUND THEN
        PERFORM pg_notify('outbox_intent_pending', '');
    END IF;
END
$$;

-- ---------------------------------------------------------------------------------------
-- Settles
-- ---------------------------------------------------------------------------------------

-- Each takes `intent_ids[k]` under lease `lease_ids[k]` (and, for Fail, the k-th of its
-- other arrays), applies to the items whose lease is the intent's, and returns the intents
-- it changed as (id, state, lease_expires_at, traceparent); the caller matches them to its
-- items (src/outbox/store/settle.rs decodes them by position). An Ack also returns the
-- intents whose ordering keys it released, as PENDING rows of their own. They fence by
-- lease only: a region-bound key's settle first asks outbox.settleable_in_regions.
--
-- Each joins its batch (`unnest(intent_ids, lease_ids, …)`) to the intents by hash and
-- reads the intents by primary key (`i.id = ANY (intent_ids)`), nested loops and merge
-- joins off: with only nested loops the planner put the primary-key scan outside and the
-- batch inside and matched every intent against every item (an Ack of 1,000 spent 240 of
-- its 246 ms there); the hash join is linear (18 ms), on a tiny table as on a large one.

-- Ack at a retention above zero: deletes each intent it delivers that has no idempotency
-- key, no ordering key and priority 0 from outbox.intent and stores it DELIVERED in
-- outbox.delivered_batch, one row per (tenant, region, bucket); the rest goes to
-- outbox.ack_the_rest. An intent with another priority stays in outbox.intent, DELIVERED in
-- place: a history item (outbox.delivered_intent_v1) has no priority, and such an intent
-- read back from there would say 0.
CREATE FUNCTION outbox.ack_into_batches(
    tenants text,
    scope_proof text,
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
SET enable_hashjoin = on
SET enable_mergejoin = off
SET enable_nestloop = off
AS $$
#variable_conflict use_column
DECLARE
    delivered_at timestamptz := coalesce(as_of, now());
    moved bigint;
BEGIN
    PERFORM outbox.enter_scope(tenants, scope_proof);
    RETURN QUERY
        WITH delivered AS (
            DELETE FROM outbox.intent i
            USING unnest(intent_ids, lease_ids) AS input(id, lease_id)
            WHERE i.id = ANY (intent_ids)
              AND i.id = input.id
              AND i.lease_id = input.lease_id
              AND i.state IN ('leased', 'submitted', 'needs_reconcile')
              AND i.idempotency_key IS NULL
              AND i.ordering_key IS NULL
              AND i.priority = 0
            RETURNING i.*
        ),
        stored AS (
            -- One Agg node feeds both arrays the same rows in the same order, so ids[k]
            -- is items[k]'s id.
            INSERT INTO outbox.delivered_batch (bucket, tenant_id, region, finished_at, ids, items)
            SELECT outbox.history_bucket(d.id), d.tenant_id, d.region, delivered_at,
                   array_agg(d.id),
                   array_agg(ROW(
                       d.id, d.tenant_id, d.kind, d.region, d.payload, d.content_type,
                       d.headers, NULL, 'delivered', d.attempts, d.max_attempts,
                       d.available_at, d.created_at, delivered_at, d.lease_id, NULL,
                       d.worker_id, NULL, d.last_error, delivered_at, d.txn_xid
                   )::outbox.delivered_intent_v1)
            FROM delivered d
            GROUP BY outbox.history_bucket(d.id), d.tenant_id, d.region
        )
        SELECT d.id, 'delivered'::outbox.intent_state, NULL::timestamptz,
               d.headers->>'traceparent'
        FROM delivered d;
    GET DIAGNOSTICS moved = ROW_COUNT;
    IF moved < cardinality(intent_ids) THEN
        RETURN QUERY
            SELECT * FROM outbox.ack_the_rest(intent_ids, lease_ids, delivered_at, moved, true);
    END IF;
END
$$;

-- Ack at retention zero: the purge would delete a delivered intent at its next run, so
-- the Ack deletes it instead (no new row version, no index entries for the purge to delete
-- again; the claim-and-ack ceiling rose from 27-31k to 43.5k intents/s). Only intents
-- without an idempotency key: a keyed one is left to outbox.ack_the_rest, DELIVERED in
-- place, where the unique index still guards its key until the key's window
-- (OUTBOX_RETENTION__IDEMPOTENCY_KEYS) is over; with the row would go the key, and a
-- producer retrying an Enqueue whose answer it lost would record the intent twice. Ordered
-- intents are left to outbox.ack_the_rest too (their keys move on).
CREATE FUNCTION outbox.ack_and_delete(
    tenants text,
    scope_proof text,
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
SET enable_hashjoin = on
SET enable_mergejoin = off
SET enable_nestloop = off
AS $$
#variable_conflict use_column
DECLARE
    deleted bigint;
BEGIN
    PERFORM outbox.enter_scope(tenants, scope_proof);
    RETURN QUERY
        DELETE FROM outbox.intent i
        USING unnest(intent_ids, lease_ids) AS input(id, lease_id)
        WHERE i.id = ANY (intent_ids)
          AND i.id = input.id
          AND i.lease_id = input.lease_id
          AND i.state IN ('leased', 'submitted', 'needs_reconcile')
          AND i.idempotency_key IS NULL
          AND i.ordering_key IS NULL
        RETURNING i.id, 'delivered'::outbox.intent_state, NULL::timestamptz,
                  i.headers->>'traceparent';
    GET DIAGNOSTICS deleted = ROW_COUNT;
    IF deleted < cardinality(intent_ids) THEN
        RETURN QUERY
            SELECT * FROM outbox.ack_the_rest(intent_ids, lease_ids, coalesce(as_of, now()),
                                              deleted, false);
    END IF;
END
$$;

-- What an Ack's first statement left after it took `done` intents (those without an
-- idempotency or ordering key): first what stays is marked DELIVERED in place (idempotency
-- keys; priorities other than 0 above retention zero, a history item having none), so that
-- their Acks cost no more; then, if some are left, the ordered ones without an idempotency
-- key leave the live table, into the history with their keys (into_history) or deleted
-- (retention zero): one row version less each than an in-place DELIVERED. Lost leases and
-- replays match neither. Then, all their rows locked, the keys of both move on in one round
-- (outbox.release_keys: an Ack locks its heads, then their keys, then the next intents),
-- returned as PENDING rows of their own so that the server wakes claimers after the
-- commit. Runs in the Ack's scope.
CREATE FUNCTION outbox.ack_the_rest(
    intent_ids uuid[],
    lease_ids uuid[],
    delivered_at timestamptz,
    done bigint,
    into_history boolean
) RETURNS TABLE (
    id uuid,
    state outbox.intent_state,
    lease_expires_at timestamptz,
    traceparent text
)
LANGUAGE plpgsql VOLATILE
AS $$
#variable_conflict use_column
DECLARE
    done_ids uuid[];
    done_traceparents text[];
    key_tenants text[];
    key_names text[];
BEGIN
    WITH marked AS (
        UPDATE outbox.intent i
        SET state = 'delivered',
            lease_expires_at = NULL,
            claim_request_id = NULL,
            finished_at = delivered_at,
            updated_at = delivered_at
        FROM unnest(intent_ids, lease_ids) AS input(id, lease_id)
        WHERE i.id = ANY (intent_ids)
          AND i.id = input.id
          AND i.lease_id = input.lease_id
          AND i.state IN ('leased', 'submitted', 'needs_reconcile')
          AND (i.ordering_key IS NULL OR i.idempotency_key IS NOT NULL
               OR (i.priority <> 0 AND into_history))
        RETURNING i.id, i.headers->>'traceparent' AS traceparent, i.tenant_id, i.ordering_key
    )
    SELECT array_agg(m.id), array_agg(m.traceparent),
           array_agg(m.tenant_id) FILTER (WHERE m.ordering_key IS NOT NULL),
           array_agg(m.ordering_key) FILTER (WHERE m.ordering_key IS NOT NULL)
    INTO done_ids, done_traceparents, key_tenants, key_names
    FROM marked m;
    IF done + coalesce(cardinality(done_ids), 0) < cardinality(intent_ids) THEN
        -- What the update left: its rows are DELIVERED now, outside the state test.
        WITH moved AS (
            DELETE FROM outbox.intent i
            USING unnest(intent_ids, lease_ids) AS input(id, lease_id)
            WHERE i.id = ANY (intent_ids)
              AND i.id = input.id
              AND i.lease_id = input.lease_id
              AND i.state IN ('leased', 'submitted', 'needs_reconcile')
            RETURNING i.*
        ),
        stored AS (
            -- As outbox.ack_into_batches stores the unordered ones, with the keys (one Agg
            -- node: the arrays in the same order).
            INSERT INTO outbox.delivered_batch (bucket, tenant_id, region, finished_at, ids,
                                                items, ordering_keys)
            SELECT outbox.history_bucket(d.id), d.tenant_id, d.region, delivered_at,
                   array_agg(d.id),
                   array_agg(ROW(
                       d.id, d.tenant_id, d.kind, d.region, d.payload, d.content_type,
                       d.headers, NULL, 'delivered', d.attempts, d.max_attempts,
                       d.available_at, d.created_at, delivered_at, d.lease_id, NULL,
                       d.worker_id, NULL, d.last_error, delivered_at, d.txn_xid
                   )::outbox.delivered_intent_v1),
                   array_agg(d.ordering_key)
            FROM moved d
            WHERE into_history
            GROUP BY outbox.history_bucket(d.id), d.tenant_id, d.region
        )
        SELECT done_ids || array_agg(d.id),
               done_traceparents || array_agg(d.headers->>'traceparent'),
               key_tenants || array_agg(d.tenant_id), key_names || array_agg(d.ordering_key)
        INTO done_ids, done_traceparents, key_tenants, key_names
        FROM moved d;
    END IF;
    RETURN QUERY
        SELECT u.id, 'delivered'::outbox.intent_state, NULL::timestamptz, u.traceparent
        FROM unnest(done_ids, done_traceparents) AS u(id, traceparent);
    IF key_names IS NOT NULL THEN
        RETURN QUERY
            SELECT r.id, 'pending'::outbox.intent_state, NULL::timestamptz, NULL::text
            FROM outbox.release_keys(key_tenants, key_names, delivered_at) AS r(id);
    END IF;
END
$$;

-- ExtendLease: pushes the expiry of live (LEASED or SUBMITTED) leases to
-- `as_of + lease_ms`, never back: a call whose statement waited on a row lock (behind a
-- stalled transaction) kept its transaction's now(); committed after a later extension of
-- the same lease, it set the expiry seconds into the past, the rescue took the intent back
-- to PENDING, and it was leased again while its worker held a lease the server had just
-- extended (the fault suite's NoOverlappingLeases, seed 11220680508070879144).
--
-- Its state test is written on the state as text, as MarkSubmitted's is: as an enum test it
-- implies the predicate of intent_lease_expires_at_idx, and a plan made on a tiny table
-- scanned that whole index (every live lease) instead of the primary key.
CREATE FUNCTION outbox.extend_leases(
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

-- MarkSubmitted: moves LEASED intents to SUBMITTED; from then on a lost outcome needs an
-- operator. A worker calls it before every non-idempotent side effect.
CREATE FUNCTION outbox.mark_submitted(
    tenants text,
    scope_proof text,
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
SET enable_hashjoin = on
SET enable_mergejoin = off
SET enable_nestloop = off
AS $$
#variable_conflict use_column
BEGIN
    PERFORM outbox.enter_scope(tenants, scope_proof);
    RETURN QUERY
        UPDATE outbox.intent i
        SET state = 'submitted',
            updated_at = coalesce(as_of, now())
        FROM unnest(intent_ids, lease_ids) AS input(id, lease_id)
        WHERE i.id = ANY (intent_ids)
          AND i.id = input.id
          AND i.lease_id = input.lease_id
          -- As text: see outbox.extend_leases.
          AND i.state::text = 'leased'
        RETURNING i.id, i.state, i.lease_expires_at, i.headers->>'traceparent';
END
$$;

-- Fail: item k failed with `outcomes[k]` ('retry', 'permanent' or 'unknown'), `errors[k]`
-- and, for a retry, `retry_after_ms[k]` (NULL: the backoff,
-- `least(cap_ms, base_ms * 2^(attempts - 1))` with jitter). RETRY → PENDING after it, or
-- DEAD_LETTERED when attempts are used up; PERMANENT → DEAD_LETTERED; UNKNOWN →
-- NEEDS_RECONCILE. Accepted from a live lease, and a definite outcome (RETRY, PERMANENT)
-- also from the last lease of a NEEDS_RECONCILE intent. A worker calls it for every intent
-- while its target is down.
CREATE FUNCTION outbox.fail(
    tenants text,
    scope_proof text,
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
SET enable_hashjoin = on
SET enable_mergejoin = off
SET enable_nestloop = off
AS $$
#variable_conflict use_column
DECLARE
    -- A variable, not an expression in the query (see the top of this file).
    failed_at timestamptz := coalesce(as_of, now());
BEGIN
    PERFORM outbox.enter_scope(tenants, scope_proof);
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

-- Which of `intent_ids` a key bound to `regions` may settle: intents of the caller's
-- tenants, in one of its regions or in none, live in outbox.intent (delivered ones cannot
-- be settled again; their replays are answered by the lookup that follows the settle,
-- filtered by region too). The server sends the others with a lease no intent carries, so
-- that they cannot apply and are answered NOT_FOUND, as another tenant's are: a key bound
-- to region eu holding the leaked lease of an intent of region us must not end its side
-- effect. A region never changes after Enqueue, so the answer cannot go stale before the
-- settle. One round trip more, only for keys with regions.
CREATE FUNCTION outbox.settleable_in_regions(
    tenants text,
    scope_proof text,
    intent_ids uuid[],
    regions text[]
) RETURNS SETOF uuid
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
BEGIN
    PERFORM outbox.enter_scope(tenants, scope_proof);
    RETURN QUERY
        SELECT i.id
        FROM outbox.intent i
        WHERE i.id = ANY (intent_ids)
          AND (i.region = '' OR i.region = ANY (regions));
END
$$;

-- ---------------------------------------------------------------------------------------
-- Reads
-- ---------------------------------------------------------------------------------------

-- The intents of `wanted_ids` the caller's tenants see, live or delivered. A plain SQL
-- function, so that PostgreSQL inlines it into the calling query and plans each part by
-- its index. The buckets are computed in a subquery, so that they bound the bucket index
-- scan under row-level security. In a bucket, a row is read only if its ids hold a wanted
-- one when few are wanted (GetIntent): that test compares every id with every wanted one,
-- so for a batch (a settle's replayed items) the rows of the bucket are read whole instead,
-- and their items matched through a hash of the wanted ids (a plain `= ANY` of a cached
-- plan's parameter is a linear search per item). x.unnest is the item's ordering key: a
-- multi-argument unnest appends it after the item's columns, which is where outbox.intent
-- has ordering_key; the columns after it are padded (see outbox.delivered_intent_v1).
CREATE FUNCTION outbox.intents_by_id(wanted_ids uuid[]) RETURNS SETOF outbox.intent
LANGUAGE sql STABLE
AS $$
    SELECT * FROM outbox.intent i WHERE i.id = ANY (wanted_ids)
    UNION ALL
    SELECT x.*, NULL::timestamptz, NULL::bigint, 0::smallint, NULL::bigint
    FROM outbox.delivered_batch b
    CROSS JOIN LATERAL unnest(b.items, b.ordering_keys) x
    WHERE b.bucket = ANY ((
            SELECT array_agg(DISTINCT outbox.history_bucket(w)) FROM unnest(wanted_ids) w
          )::bigint[])
      AND (cardinality(wanted_ids) > 16 OR b.ids && wanted_ids)
      AND x.id IN (SELECT unnest(wanted_ids))
$$;

-- Whether every state of a ListIntents filter is one that is few however large the table
-- grows, each with a partial index: the operator's queues, staged, live leases, waiting.
CREATE FUNCTION outbox.are_few(states outbox.intent_state[]) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT cardinality(states) > 0
       AND states <@ ARRAY['needs_reconcile', 'dead_lettered', 'staged', 'leased',
                           'submitted', 'waiting']::outbox.intent_state[]
$$;

-- A page of ListIntents of such states (outbox.are_few), oldest first, read through their
-- partial indexes then sorted. Under row-level security the planner may not read the
-- state column's statistics (enum equality is not leakproof), guesses a sixth of the table
-- per state, and walked the primary key past every other row (0.2-0.3 s at 1M intents for
-- a page of NEEDS_RECONCILE); without index scans (nor JIT, which that costing would
-- trigger) only the bitmap scans of the partial indexes remain.
CREATE FUNCTION outbox.few_intents(
    states outbox.intent_state[], kind_is text, region_is text, key_regions text[],
    ordering_key_is text, undecided_only boolean, after uuid, page bigint
) RETURNS SETOF outbox.intent
LANGUAGE sql STABLE
SET enable_seqscan = off
SET enable_indexscan = off
SET jit = off
AS $$
    SELECT i.*
    FROM outbox.intent i
    WHERE i.state = ANY(states)
      AND (i.state IN ('needs_reconcile', 'dead_lettered', 'staged')
           OR (i.state IN ('leased', 'submitted') AND i.lease_expires_at IS NOT NULL)
           OR (i.state = 'waiting' AND i.ordering_key IS NOT NULL))
      AND (kind_is IS NULL OR i.kind = kind_is)
      AND (region_is IS NULL OR i.region = region_is)
      AND (cardinality(key_regions) = 0 OR i.region = '' OR i.region = ANY(key_regions))
      AND (ordering_key_is IS NULL OR i.ordering_key = ordering_key_is)
      -- A finished dead letter (an ordered one given up) awaits no decision.
      AND (NOT undecided_only OR i.finished_at IS NULL)
      AND i.id > after
    ORDER BY i.id
    LIMIT page
$$;

-- ---------------------------------------------------------------------------------------
-- The operator console (docs/console.md)
-- ---------------------------------------------------------------------------------------

-- Opens a console session for the live key whose secret is `secret`, if it may operate or
-- administer, and returns the key's id (NULL: no such key). The only way a session is
-- opened: given the key's secret, which no table holds (the key's hash is what is stored).
-- The request-serving role may find sessions and end them, never insert one
-- (…03_baseline_tenancy's grants): a statement injected into its connection could
-- otherwise open a session of an all-tenant admin key (every key's id is readable), and
-- through the console act for every tenant. As its owner, with its search_path fixed.
CREATE FUNCTION outbox.open_console_session(
    secret text, session_hash bytea, csrf text, ttl_seconds float8
) RETURNS uuid
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    signed_in uuid;
BEGIN
    SELECT k.id INTO signed_in
    FROM outbox.api_key k
    WHERE k.key_hash = sha256(convert_to(secret, 'UTF8'))
      AND k.revoked_at IS NULL
      AND k.scopes && ARRAY['operate', 'admin']::text[];
    IF signed_in IS NULL THEN
        RETURN NULL;
    END IF;
    DELETE FROM outbox.console_session s WHERE s.expires_at < now();
    INSERT INTO outbox.console_session (token_hash, key_id, csrf_token, created_at, expires_at)
    VALUES (session_hash, signed_in, csrf, now(), now() + make_interval(secs => ttl_seconds));
    RETURN signed_in;
END
$$;
