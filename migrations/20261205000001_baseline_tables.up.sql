-- The outbox's tables, indexes and views (baseline of 0.1.0). Row-level security, roles and
-- grants are in …03_baseline_tenancy, the functions in …02_baseline_functions.
--
-- Migrations after this one are additive: a new file per change, never an edit of one
-- that has shipped.

-- Its own schema, so that the outbox can share a database with the producer's tables (the
-- two-phase token needs one cluster, and producers in the same database are common).
CREATE SCHEMA IF NOT EXISTS outbox;

-- The lifecycle of an intent (docs/design.md). Every transition is one guarded UPDATE in
-- src/outbox/store/; the CHECK constraints make impossible rows unwritable.
CREATE TYPE outbox.intent_state AS ENUM (
    'staged',
    'pending',
    'leased',
    'submitted',
    'delivered',
    'needs_reconcile',
    'dead_lettered',
    'discarded'
);

-- The live intents. Delivered intents without an idempotency key leave this table at Ack
-- (into outbox.delivered_batch), so claims and settles read a table of live rows.
--
-- fillfactor 50: every transition writes a new version of the row, and none can be HOT
-- (each changes `state`, which the partial indexes read). With half of each page free the
-- new version lands on the row's own page, where PostgreSQL logs only the bytes that
-- changed and pruning frees the old one (WAL per 1k delivered intents 892 → 720 KiB).
-- The cost: a backlog takes twice the pages at rest.
CREATE TABLE outbox.intent (
    -- UUIDv7 minted by outboxd: time ordered, so the primary key index stays append-mostly.
    id uuid PRIMARY KEY,
    tenant_id text NOT NULL DEFAULT 'default',
    -- Routing key workers filter on.
    kind text NOT NULL,
    -- Region whose workers may claim it; '' means any worker.
    region text NOT NULL DEFAULT '',
    payload bytea NOT NULL,
    content_type text NOT NULL DEFAULT '',
    -- String-to-string map; traceparent travels here.
    headers jsonb NOT NULL DEFAULT '{}',
    -- Per-tenant deduplication key; remembered while the row is retained.
    idempotency_key text,
    state outbox.intent_state NOT NULL,
    -- Incremented at claim, so a crash mid-delivery still counts the attempt.
    attempts integer NOT NULL DEFAULT 0,
    max_attempts integer NOT NULL,
    -- Not claimable before this instant (delay, retry backoff).
    available_at timestamptz NOT NULL,
    created_at timestamptz NOT NULL,
    updated_at timestamptz NOT NULL,
    -- Fencing token of the current (or last settled) lease.
    lease_id uuid,
    lease_expires_at timestamptz,
    worker_id text,
    -- Claim request id, so a retried Claim returns the same leases.
    claim_request_id text,
    last_error text,
    -- When it reached a final state; retention purges by it.
    finished_at timestamptz,
    -- Producer transaction of a two-phase enqueue (STAGED until it finishes).
    txn_xid xid8,
    CONSTRAINT intent_attempts_in_range CHECK (attempts >= 0 AND max_attempts >= 1),
    CONSTRAINT intent_live_lease_is_complete CHECK (
        state NOT IN ('leased', 'submitted')
        OR (lease_id IS NOT NULL AND lease_expires_at IS NOT NULL)
    ),
    CONSTRAINT intent_staged_has_txn CHECK (state <> 'staged' OR txn_xid IS NOT NULL),
    CONSTRAINT intent_finished_has_time CHECK (
        state NOT IN ('delivered', 'discarded') OR finished_at IS NOT NULL
    )
) WITH (fillfactor = 50);

-- Claim scans this in order: tiny, because only PENDING rows are in it, however much
-- history the table holds.
CREATE INDEX intent_claimable_idx ON outbox.intent (available_at, id)
    WHERE state = 'pending';

-- The lease rescuer finds expired leases, and the queue gauges count live ones, without
-- scanning history.
CREATE INDEX intent_lease_expires_at_idx ON outbox.intent (lease_expires_at)
    WHERE state IN ('leased', 'submitted');

-- Retention purges finished rows oldest first.
CREATE INDEX intent_finished_at_idx ON outbox.intent (finished_at)
    WHERE state IN ('delivered', 'discarded');

-- Staged rows are resolved against pg_xact_status by transaction.
CREATE INDEX intent_txn_xid_idx ON outbox.intent (txn_xid)
    WHERE state = 'staged';

-- Operator queues (reconcile, dead letters) and staged intents, by tenant. Not LEASED or
-- SUBMITTED rows: this index would then match the state test of every settle, and since
-- the leased set is small whenever ANALYZE looks, the planner chose it over the primary key
-- to find each intent by id (a scan of the whole index per id; burn-down ~40k → ~27k/s).
CREATE INDEX intent_tenant_state_idx ON outbox.intent (tenant_id, state, id)
    WHERE state IN ('needs_reconcile', 'dead_lettered', 'staged');

-- Idempotency keys are unique per tenant among intents that exist: a DISCARDED intent (its
-- producer rolled back) never existed, so its key is free for the producer's retry. This
-- index is what makes a key's second Enqueue find the first, which is why keyed intents stay
-- in this table, DELIVERED, for their key's window.
CREATE UNIQUE INDEX intent_tenant_idempotency_key_idx ON outbox.intent (tenant_id, idempotency_key)
    WHERE idempotency_key IS NOT NULL AND state <> 'discarded';

-- A retried Claim finds the leases its first attempt took.
CREATE INDEX intent_claim_request_idx ON outbox.intent (tenant_id, worker_id, claim_request_id)
    WHERE claim_request_id IS NOT NULL AND state IN ('leased', 'submitted');

-- Every operator decision: who, when, why. Kept after the intent is purged.
CREATE TABLE outbox.resolution (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id text NOT NULL,
    intent_id uuid NOT NULL,
    from_state outbox.intent_state NOT NULL,
    decision text NOT NULL,
    actor text NOT NULL,
    reason text NOT NULL,
    resolved_at timestamptz NOT NULL,
    CONSTRAINT resolution_decision_known CHECK (decision IN ('delivered', 'requeue', 'dead'))
);

CREATE INDEX resolution_intent_idx ON outbox.resolution (intent_id, id);

-- API keys: only a SHA-256 of the secret is stored. Keys are looked up before the tenant
-- is known, so this table has no tenant policy; outboxd's roles may read it and nothing
-- else (keys are written by the owner, through `outboxd keys`).
CREATE TABLE outbox.api_key (
    id uuid PRIMARY KEY,
    -- Human label shown in listings and logs.
    name text NOT NULL,
    -- First characters of the secret, to recognise a key without storing it.
    prefix text NOT NULL,
    key_hash bytea NOT NULL,
    -- Tenants the key acts for; ignored when all_tenants.
    tenants text[] NOT NULL,
    all_tenants boolean NOT NULL DEFAULT false,
    scopes text[] NOT NULL,
    -- Regions the key is limited to; empty means any.
    regions text[] NOT NULL DEFAULT '{}',
    created_at timestamptz NOT NULL DEFAULT now(),
    revoked_at timestamptz,
    CONSTRAINT api_key_hash_unique UNIQUE (key_hash),
    CONSTRAINT api_key_scopes_known CHECK (
        scopes <@ ARRAY['produce', 'consume', 'operate', 'admin']::text[] AND cardinality(scopes) > 0
    ),
    CONSTRAINT api_key_has_tenants CHECK (all_tenants OR cardinality(tenants) > 0),
    -- A request's tenants reach the row-level security policies as one comma-separated
    -- setting (outbox.tenants): a name with a comma, written here by hand, would read as
    -- two tenants. `outboxd keys` never writes one; this refuses it from any writer.
    CONSTRAINT api_key_tenants_are_single_names CHECK (
        strpos(array_to_string(tenants, ''), ',') = 0 AND NOT ('' = ANY (tenants))
    )
);

-- An intent in the delivered history: outbox.intent's columns, in its order, so that `x.*`
-- of an item is an outbox.intent row. A type of its own, versioned by name, not
-- outbox.intent's row type: a column of a table's row type makes every later ALTER TABLE
-- outbox.intent ADD COLUMN fail. A column added to outbox.intent gets a _v2 type (and
-- column) read beside this one, or v1 items padded with NULL.
CREATE TYPE outbox.delivered_intent_v1 AS (
    id uuid,
    tenant_id text,
    kind text,
    region text,
    payload bytea,
    content_type text,
    headers jsonb,
    idempotency_key text,
    state outbox.intent_state,
    attempts integer,
    max_attempts integer,
    available_at timestamptz,
    created_at timestamptz,
    updated_at timestamptz,
    lease_id uuid,
    lease_expires_at timestamptz,
    worker_id text,
    claim_request_id text,
    last_error text,
    finished_at timestamptz,
    txn_xid xid8
);

-- The delivered history, a batch to a row: each Ack stores the intents without an
-- idempotency key it delivers as one row per (tenant, region, bucket), the intents an array
-- (TOASTed, compressed). A row per intent (a heap tuple, its WAL and two index entries,
-- ~7 µs of PostgreSQL's CPU each) was the whole gap between the burn-down at the default
-- retention (44-47k/s) and at retention zero (55-60k/s); a batch a row runs as fast as
-- deleting, in a table 8x smaller.
--
-- Finding one delivered intent needs no index entry per intent: every intent of a row has
-- the row's bucket, outbox.history_bucket(id) (the UUIDv7's milliseconds / 100), so an id
-- names its bucket and a lookup reads that bucket's rows alone (outbox.intents_by_id). Ids
-- are ordered as their buckets are, so a page in id order walks the bucket index in order.
CREATE TABLE outbox.delivered_batch (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- outbox.history_bucket of every id in the row.
    bucket bigint NOT NULL,
    tenant_id text NOT NULL,
    region text NOT NULL,
    -- When the Ack delivered them: the retention purges whole rows by it.
    finished_at timestamptz NOT NULL,
    -- The items' ids, in the items' order: what a lookup tests without reading the items.
    ids uuid[] NOT NULL,
    items outbox.delivered_intent_v1[] NOT NULL,
    CONSTRAINT delivered_batch_ids_match_items CHECK (cardinality(ids) = cardinality(items))
);

-- Ids are random after their timestamp: compressing them gains nothing and costs the Ack.
ALTER TABLE outbox.delivered_batch ALTER COLUMN ids SET STORAGE EXTERNAL;
-- lz4 where the server was built with it (cheaper than pglz, and it compresses better
-- here); the default (pglz) otherwise.
DO $$
BEGIN
    ALTER TABLE outbox.delivered_batch ALTER COLUMN items SET COMPRESSION lz4;
EXCEPTION WHEN feature_not_supported OR invalid_parameter_value THEN
    NULL;
END
$$;

-- Lookups by id (the bucket of each id), and pages in id order.
CREATE INDEX delivered_batch_bucket_idx ON outbox.delivered_batch (bucket);
-- Retention purges oldest first.
CREATE INDEX delivered_batch_finished_at_idx ON outbox.delivered_batch (finished_at);

-- Every intent, live or delivered, the batches unnested: for tools and tests, never a hot
-- path (the server reads by id through outbox.intents_by_id). security_invoker: the
-- tables' policies apply to the caller, not to the view's owner (who may be a superuser,
-- and bypass them).
CREATE VIEW outbox.all_intents WITH (security_invoker = true) AS
    SELECT * FROM outbox.intent
    UNION ALL
    SELECT x.* FROM outbox.delivered_batch b CROSS JOIN LATERAL unnest(b.items) x;
