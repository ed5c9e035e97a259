-- The outbox's tables, indexes, types and views. The functions and the insert trigger are
-- in …02_baseline_functions; row-level security, the fleet role, the scope secret and the
-- grants in …03_baseline_tenancy.
--
-- Migrations after this baseline are additive: a new file per change, never an edit of one
-- that has shipped.

-- Its own schema, so that the outbox can share a database with the producer's tables (the
-- two-phase token needs one cluster, and producers in the same database are common).
CREATE SCHEMA IF NOT EXISTS outbox;

-- The lifecycle of an intent (docs/design.md). Every transition is one guarded UPDATE in
-- src/outbox/store/; the CHECK constraints make impossible rows unwritable.
CREATE TYPE outbox.intent_state AS ENUM (
    'staged',
    -- An intent of an ordering key behind an earlier one of that key that has not finished
    -- (docs/ordering.md).
    'waiting',
    'pending',
    'leased',
    'submitted',
    'delivered',
    'needs_reconcile',
    'dead_lettered',
    'discarded',
    -- An operator's decision that an intent not delivered yet never will be (CANCEL).
    'cancelled'
);

-- ---------------------------------------------------------------------------------------
-- Intents
-- ---------------------------------------------------------------------------------------

-- The live intents. Delivered intents without an idempotency key leave this table at Ack
-- (into outbox.delivered_batch, or deleted at retention zero), so claims and settles read
-- a table of live rows. Above retention zero an intent with a priority other than 0 stays,
-- DELIVERED in place: a history item has no priority.
--
-- fillfactor 50: every transition writes a new version of the row, and none can be HOT
-- (each changes `state`, which the partial indexes read). With half of each page free the
-- new version lands on the row's own page, where PostgreSQL logs only the bytes that
-- changed and pruning frees the old one (WAL per 1k delivered intents 892 → 720 KiB).
-- The cost: a backlog takes twice the pages at rest.
--
-- Per-key ordering (docs/ordering.md): among the intents of one tenant and ordering key,
-- one at a time is the key's head (STAGED, PENDING, LEASED, SUBMITTED, NEEDS_RECONCILE, or
-- DEAD_LETTERED without an operator's decision); the others are WAITING, outside the
-- claimable index, so that a key's backlog costs a claim nothing. "Next" is commit order:
-- every ordered intent carries the transaction that made it exist (txn_xid: the
-- producer's for a two-phase Enqueue, outboxd's own for a direct one) and, when needed,
-- that transaction's commit time (PostgreSQL records it only with track_commit_timestamp
-- on, so ordered intents need it).
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
    -- Digest of the Claim that leased it (outbox.claim_request_digest of the worker, the
    -- scope and the request id; unindexed): a retried Claim answers the leases of
    -- outbox.claim_request that still carry it.
    claim_request_id text,
    last_error text,
    -- When it reached a final state; retention purges by it.
    finished_at timestamptz,
    -- Producer transaction of a two-phase enqueue (STAGED until it finishes); for an ordered
    -- intent, the transaction that made it exist.
    txn_xid xid8,
    -- Intents of one tenant and ordering key are delivered one at a time, in commit order.
    ordering_key text,
    -- Commit time of txn_xid: set when a STAGED intent's transaction commits, and for a
    -- direct one only once its key also holds a promoted two-phase intent (among direct
    -- Enqueues of a key, which hold its lock to their commit, insertion order is commit
    -- order).
    order_ts timestamptz,
    -- Ties within one transaction (and of equal commit times): insertion order
    -- (outbox.intent_order_seq).
    order_seq bigint,
    -- Within a queue (tenant, kind), higher priorities are claimed first (docs/flow-control.md).
    priority smallint NOT NULL DEFAULT 0,
    -- A level's key in the claimable index: a hash of its tenant, kind and priority
    -- (`hashtextextended(tenant_id || '/' || kind, priority)`, the same expression as
    -- outbox.queue_level's), not the three columns, whose width made every insert 20% dearer
    -- (+58 B of WAL an intent). Two levels with one hash share a range; queries test the
    -- columns too. A stored column, not an expression index: under row-level security a
    -- condition on a function of a row's columns is not an index condition unless the
    -- function is LEAKPROOF (which only a superuser may declare), and claims scanned the
    -- whole index. Written by the inserts (enqueue*.sql), not generated: a stored generated
    -- column re-forms every row written, claims and Acks too (7% of an insert).
    level_key bigint NOT NULL,
    CONSTRAINT intent_attempts_in_range CHECK (attempts >= 0 AND max_attempts >= 1),
    CONSTRAINT intent_live_lease_is_complete CHECK (
        state NOT IN ('leased', 'submitted')
        OR (lease_id IS NOT NULL AND lease_expires_at IS NOT NULL)
    ),
    CONSTRAINT intent_staged_has_txn CHECK (state <> 'staged' OR txn_xid IS NOT NULL),
    CONSTRAINT intent_finished_has_time CHECK (
        state NOT IN ('delivered', 'discarded', 'cancelled') OR finished_at IS NOT NULL
    ),
    CONSTRAINT intent_ordered_is_complete CHECK (
        ordering_key IS NULL OR (txn_xid IS NOT NULL AND order_seq IS NOT NULL)
    ),
    CONSTRAINT intent_waiting_is_ordered CHECK (state <> 'waiting' OR ordering_key IS NOT NULL),
    CONSTRAINT intent_priority_in_range CHECK (priority BETWEEN -10 AND 10)
) WITH (fillfactor = 50);

-- A claim takes a level (tenant, kind, priority) oldest first from here: tiny, because only
-- PENDING rows are in it, however much history the table holds.
CREATE INDEX intent_level_claimable_idx ON outbox.intent (level_key, available_at, id)
    WHERE state = 'pending';

-- The lease rescuer finds expired leases, and the queue gauges and concurrency limits count
-- live ones, without scanning history.
CREATE INDEX intent_lease_expires_at_idx ON outbox.intent (lease_expires_at)
    WHERE state IN ('leased', 'submitted');

-- Retention purges finished rows oldest first.
CREATE INDEX intent_finished_idx ON outbox.intent (finished_at)
    WHERE state IN ('delivered', 'discarded', 'cancelled');

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

-- A key's head, if any: what outbox.release_keys tests, and what the queue statistics count
-- as blocked keys. `ordering_key IS NOT NULL` keeps it off every statement that does not
-- name a key (settles, claims), whose state tests would otherwise match its predicate.
CREATE INDEX intent_ordering_head_idx ON outbox.intent (tenant_id, ordering_key, state)
    WHERE ordering_key IS NOT NULL
      AND state IN ('staged', 'pending', 'leased', 'submitted', 'needs_reconcile',
                    'dead_lettered');

-- A key's WAITING intents in commit order; those whose commit time is not known yet last.
CREATE INDEX intent_ordering_waiting_idx
    ON outbox.intent (tenant_id, ordering_key, order_ts, order_seq)
    WHERE state = 'waiting';

-- order_seq of ordered intents: insertion order, the tie-break within a transaction.
CREATE SEQUENCE outbox.intent_order_seq;

-- Every operator decision: who, when, why. Kept after the intent is purged. CANCEL turns
-- STAGED, WAITING or PENDING intents CANCELLED, final (docs/design.md, "Reconcile").
CREATE TABLE outbox.resolution (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id text NOT NULL,
    intent_id uuid NOT NULL,
    from_state outbox.intent_state NOT NULL,
    decision text NOT NULL,
    actor text NOT NULL,
    reason text NOT NULL,
    resolved_at timestamptz NOT NULL,
    CONSTRAINT resolution_decision_known
        CHECK (decision IN ('delivered', 'requeue', 'dead', 'cancel'))
);

CREATE INDEX resolution_intent_idx ON outbox.resolution (intent_id, id);

-- ---------------------------------------------------------------------------------------
-- The delivered history
-- ---------------------------------------------------------------------------------------

-- An intent in the delivered history: outbox.intent's columns up to txn_xid, in its order,
-- so that `x.*` of an item starts as an outbox.intent row. A type of its own, versioned by
-- name, not outbox.intent's row type: a column of a table's row type makes every later
-- ALTER TABLE outbox.intent ADD COLUMN fail. The readers append the item's ordering key
-- (outbox.delivered_batch.ordering_keys) and pad the columns after it (order_ts, order_seq
-- and level_key NULL, priority 0: only priority-0 intents go to the history). A column
-- added to outbox.intent gets a _v2 type (and column) read beside this one, or v1 items
-- padded as those.
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
-- idempotency key it delivers (at priority 0) as one row per (tenant, region, bucket), the
-- intents an array (TOASTed, compressed). A row per intent (a heap tuple, its WAL and two
-- index entries, ~7 µs of PostgreSQL's CPU each) was the whole gap between the burn-down at
-- the default retention (44-47k/s) and at retention zero (55-60k/s); a batch a row runs as
-- fast as deleting, in a table 8x smaller. Ordered intents go here too, with their keys:
-- one row version less each than an in-place DELIVERED, and the live table keeps the size
-- of the backlog.
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
    -- The items' ordering keys, in the items' order (NULL in a row without ordered items);
    -- readers unnest them beside the items, where outbox.intent has ordering_key.
    ordering_keys text[],
    CONSTRAINT delivered_batch_ids_match_items CHECK (cardinality(ids) = cardinality(items))
);

-- NOT VALID: databases that reached this schema before the baseline keep their older
-- rows, which have no keys, unchecked; declared alike here so that every database has the
-- same schema. New rows are checked all the same.
ALTER TABLE outbox.delivered_batch ADD CONSTRAINT delivered_batch_keys_match_items
    CHECK (ordering_keys IS NULL OR cardinality(ordering_keys) = cardinality(ids)) NOT VALID;

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
-- path (the server reads by id through outbox.intents_by_id). x.unnest is the item's
-- ordering key: a multi-argument unnest appends it after the item's columns, which is where
-- outbox.intent has ordering_key; the columns after it are padded (see
-- outbox.delivered_intent_v1). security_invoker: the tables' policies apply to the caller,
-- not to the view's owner (who may be a superuser, and bypass them).
CREATE VIEW outbox.all_intents WITH (security_invoker = true) AS
    SELECT * FROM outbox.intent
    UNION ALL
    SELECT x.*, NULL::timestamptz, NULL::bigint, 0::smallint, NULL::bigint
    FROM outbox.delivered_batch b CROSS JOIN LATERAL unnest(b.items, b.ordering_keys) x;

-- ---------------------------------------------------------------------------------------
-- Flow control (docs/flow-control.md)
-- ---------------------------------------------------------------------------------------
--
-- A queue is a (tenant, kind); a level is a queue's intents of one priority. Claims walk
-- the levels registered in outbox.queue_level, take each level oldest first through the
-- claimable index, and share a batch among tenants, then among a tenant's kinds. A queue's
-- policy (outbox.queue_policy: paused, a concurrency limit, a token-bucket rate) is read
-- and, when it limits, locked by the claim that takes from it, so that it holds across
-- replicas.

-- Every level that ever held an intent, registered by the Enqueue statements themselves
-- and, for every other insert, by the insert trigger (…02_baseline_functions). Never
-- emptied by outboxd: kinds are few (a kind per entity belongs in ordering_key or a
-- header, see docs/flow-control.md).
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

-- ---------------------------------------------------------------------------------------
-- Claim replays
-- ---------------------------------------------------------------------------------------

-- A claim with a request id writes one row here: the ids it leased, kept for its lease
-- duration (one row per claim, not an index entry per intent: 0.3-0.5 ms of a claim of
-- 100). A replay reads them by primary key and answers those still leased to the same
-- worker under the same digest (kept on the intent, outbox.intent.claim_request_id). The
-- sweep of expired leases deletes the expired rows (store::forget_claim_requests): a lease
-- extended past its claim's duration is replayed only until the sweep, as a worker that
-- never had the answer cannot have extended it.
CREATE TABLE outbox.claim_request (
    -- outbox.claim_request_digest of the worker, the claim's scope and its request id.
    digest text PRIMARY KEY,
    -- The claiming scope's tenants (none: a fleet claim's, which only the fleet sees).
    scope_tenants text[] NOT NULL,
    intent_ids uuid[] NOT NULL,
    expires_at timestamptz NOT NULL
);

CREATE INDEX claim_request_expires_at_idx ON outbox.claim_request (expires_at);

-- ---------------------------------------------------------------------------------------
-- API keys and the operator console
-- ---------------------------------------------------------------------------------------

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

-- A console sign-in (docs/console.md). The cookie carries a random secret; only its SHA-256
-- is stored (as for API keys). A session lives no longer than its key: the lookup joins the
-- live key, so revoking a key ends its sessions at once. Opened only by
-- outbox.open_console_session, given the key's secret (…02_baseline_functions).
CREATE TABLE outbox.console_session (
    token_hash bytea PRIMARY KEY,
    key_id uuid NOT NULL REFERENCES outbox.api_key (id) ON DELETE CASCADE,
    -- The token every form of the session carries (CSRF).
    csrf_token text NOT NULL,
    created_at timestamptz NOT NULL,
    expires_at timestamptz NOT NULL
);

-- Sign-ins remove expired sessions.
CREATE INDEX console_session_expires_at_idx ON outbox.console_session (expires_at);

-- Intents leased per minute, for the console's chart (docs/console.md): each replica that
-- serves the console counts what its Claims lease (its enqueues' hand-offs included) in
-- memory, by tenant, region and minute, and adds the counts here every second. A Claim
-- writes nothing more for it. Kept two hours.
CREATE TABLE outbox.claim_tally (
    minute timestamptz NOT NULL,
    tenant_id text NOT NULL,
    region text NOT NULL,
    claimed bigint NOT NULL,
    PRIMARY KEY (minute, tenant_id, region)
);
