-- The outbox lives in its own schema so it can share a database with the producer's
-- tables (the two-phase token needs one cluster, and same-database producers are common).
CREATE SCHEMA IF NOT EXISTS outbox;

-- Lifecycle of an intent (shared/DESIGN.md). Every transition is a guarded UPDATE in
-- src/outbox/store.rs; the CHECK constraints below make impossible rows unwritable.
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

CREATE TABLE outbox.intent (
    -- UUIDv7 minted by outboxd: time ordered, so the primary key index stays append-mostly.
    id uuid PRIMARY KEY,
    -- Every row belongs to a tenant from day one; one default tenant until tenancy lands.
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
);

-- Claim scans this in order: tiny, because only PENDING rows are in it, however much
-- history the table holds.
CREATE INDEX intent_claimable_idx ON outbox.intent (available_at, id)
    WHERE state = 'pending';

-- The lease rescuer finds expired leases without scanning history.
CREATE INDEX intent_lease_expires_at_idx ON outbox.intent (lease_expires_at)
    WHERE state IN ('leased', 'submitted');

-- Retention purges finished rows oldest first.
CREATE INDEX intent_finished_at_idx ON outbox.intent (finished_at)
    WHERE state IN ('delivered', 'discarded');

-- Staged rows are resolved against pg_xact_status by transaction.
CREATE INDEX intent_txn_xid_idx ON outbox.intent (txn_xid)
    WHERE state = 'staged';

-- Operator queues (reconcile, dead letters) and inspection by state.
CREATE INDEX intent_tenant_state_idx ON outbox.intent (tenant_id, state, id)
    WHERE state IN ('needs_reconcile', 'dead_lettered', 'staged', 'leased', 'submitted');

-- Idempotency keys are unique per tenant among intents that exist: a DISCARDED intent (its
-- producer rolled back) never existed, so its key is free for the producer's retry.
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
