-- The operator console (docs/console.md): its sign-ins.

-- A console sign-in. The cookie carries a random secret; only its SHA-256 is stored (as
-- for API keys). A session lives no longer than its key: the lookup joins the live key,
-- so revoking a key ends its sessions at once.
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
    ordering_key_is text, after uuid, page bigint
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
      AND i.id > after
    ORDER BY i.id
    LIMIT page
$$;

-- The service role writes sign-ins (never keys: the console mints and revokes them through
-- the owner's connection, see docs/console.md).
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
    EXECUTE format('GRANT SELECT, INSERT, DELETE ON outbox.console_session TO %I', role_name);
    EXECUTE format('GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA outbox TO %I', role_name);
END;
$$;

SELECT outbox.regrant_service_roles();
