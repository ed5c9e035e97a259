-- The delivered history is stored a batch to a row. Until now Ack moved every intent it
-- delivered into outbox.intent_history as a row of its own (migration 20261201000012): a
-- heap tuple, its WAL and two index entries per intent, about 7 us of PostgreSQL's CPU
-- each, which was the whole gap between the burn-down at the default retention (44-47k
-- intents/s sustained) and at retention zero, where the Ack deletes (55-60k/s). Now the
-- Ack (outbox.ack_into_batches) deletes its intents from outbox.intent as at retention
-- zero and writes one row into outbox.delivered_batch for each (tenant, region, bucket)
-- among them, holding those intents as an array of outbox.delivered_intent_v1 (TOASTed,
-- compressed): a burn-down's Ack of 1,000 intents writes one or two rows. A pgbench
-- prototype of this shape on a 2.5M backlog ran as fast as deleting, with a history
-- table 8x smaller.
--
-- Finding one delivered intent needs no index entry per intent: the bucket of a row is
-- outbox.history_bucket(id) of every intent in it, the id's UUIDv7 millisecond timestamp
-- (its first 48 bits) divided by 100, so an id names its bucket, and a lookup reads the
-- rows of that bucket alone (index on bucket) and keeps those whose ids hold it. The work
-- is bounded by the intents created in the id's 100 ms, whatever the history's size or
-- how long the intent waited or retried. Ids are ordered as their buckets are, so a page
-- of intents in id order walks the bucket index in order and sorts within a bucket.
--
-- The items' type is a composite type of its own, versioned by name, and not outbox.intent's
-- row type: a column of a table's row type makes every later ALTER TABLE outbox.intent ADD
-- COLUMN fail. It has outbox.intent's columns, in its order, so that `x.*` of an item is an
-- outbox.intent row. A migration that adds a column to outbox.intent adds a _v2 type (and
-- column), read beside this one.
--
-- During a rolling upgrade, servers of the previous release keep calling
-- outbox.ack_into_history (unchanged) and reading outbox.all_intents, which now unnests the
-- batches too: they find every intent, reading the whole batch table for it (slow on a
-- large history, correct). So an upgrade from that release sets
-- OUTBOX_RETENTION__HISTORY_BY_BATCH false until every replica is new, and the new servers
-- call outbox.ack_into_history too until then. New servers
-- read outbox.intent_history as well, so nothing moved there is lost from sight; it is
-- purged as before.

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

-- The bucket of an intent id: its first 48 bits (a UUIDv7's Unix milliseconds) / 100. Any
-- id has one, so a lookup never fails for a non-v7 id; it only finds nothing.
CREATE FUNCTION outbox.history_bucket(id uuid) RETURNS bigint
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $$
    SELECT ('x' || encode(substring(uuid_send(id) FROM 1 FOR 6), 'hex'))::bit(48)::bigint / 100
$$;

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

ALTER TABLE outbox.delivered_batch ENABLE ROW LEVEL SECURITY;
ALTER TABLE outbox.delivered_batch FORCE ROW LEVEL SECURITY;
CREATE POLICY delivered_batch_of_current_tenants ON outbox.delivered_batch
    USING (tenant_id = ANY ((SELECT outbox.current_tenants())::text[]))
    WITH CHECK (tenant_id = ANY ((SELECT outbox.current_tenants())::text[]));
CREATE POLICY delivered_batch_cross_tenant ON outbox.delivered_batch
    USING ((SELECT outbox.cross_tenant()))
    WITH CHECK ((SELECT outbox.cross_tenant()));

-- Every intent, wherever it lives (the tools' and tests' view; the server reads by id
-- through outbox.intents_by_id). Same columns as before, so it is replaced in place.
CREATE OR REPLACE VIEW outbox.all_intents WITH (security_invoker = true) AS
    SELECT * FROM outbox.intent
    UNION ALL
    SELECT * FROM outbox.intent_history
    UNION ALL
    SELECT x.* FROM outbox.delivered_batch b CROSS JOIN LATERAL unnest(b.items) x;

-- The intents of `wanted_ids` the caller's tenants see, wherever they live. A plain SQL
-- function, so that PostgreSQL inlines it into the calling query and plans each part by
-- its index. The buckets are computed in a subquery: under row-level security only a
-- parameter (or a leakproof expression) can bound an index scan (migration
-- 20261201000008). In a bucket, a row is read only if its ids hold a wanted one when few
-- are wanted (GetIntent): that test compares every id with every wanted one, so for a
-- batch (a settle's replayed items) the rows of the bucket are read whole instead, and
-- their items matched through a hash of the wanted ids (a plain `= ANY` of a cached
-- plan's parameter is a linear search per item).
CREATE FUNCTION outbox.intents_by_id(wanted_ids uuid[]) RETURNS SETOF outbox.intent
LANGUAGE sql STABLE
AS $$
    SELECT * FROM outbox.intent i WHERE i.id = ANY (wanted_ids)
    UNION ALL
    SELECT * FROM outbox.intent_history h WHERE h.id = ANY (wanted_ids)
    UNION ALL
    SELECT x.*
    FROM outbox.delivered_batch b
    CROSS JOIN LATERAL unnest(b.items) x
    WHERE b.bucket = ANY ((
            SELECT array_agg(DISTINCT outbox.history_bucket(w)) FROM unnest(wanted_ids) w
          )::bigint[])
      AND (cardinality(wanted_ids) > 16 OR b.ids && wanted_ids)
      AND x.id IN (SELECT unnest(wanted_ids))
$$;

-- Ack at a retention above zero: `intent_ids[k]` under lease `lease_ids[k]`, from a live
-- lease or the last lease of a NEEDS_RECONCILE intent. Deletes each such intent without an
-- idempotency key from outbox.intent and stores it DELIVERED in outbox.delivered_batch,
-- one row per (tenant, region, bucket); the others (keyed intents, lost leases, replays)
-- go to outbox.ack, which marks in place, as outbox.ack_into_history did. The same
-- arguments, result and planner settings as outbox.ack_into_history (migrations
-- 20261201000012, 20261201000013).
CREATE FUNCTION outbox.ack_into_batches(
    tenants text,
    cross_tenant text,
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
    PERFORM outbox.enter_scope(tenants, cross_tenant);
    RETURN QUERY
        WITH delivered AS (
            DELETE FROM outbox.intent i
            USING unnest(intent_ids, lease_ids) AS input(id, lease_id)
            WHERE i.id = ANY (intent_ids)
              AND i.id = input.id
              AND i.lease_id = input.lease_id
              AND i.state IN ('leased', 'submitted', 'needs_reconcile')
              AND i.idempotency_key IS NULL
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
        -- What is left (keyed intents, lost leases, replays) is outbox.ack's: in place.
        RETURN QUERY
            SELECT * FROM outbox.ack(tenants, cross_tenant, intent_ids, lease_ids, delivered_at);
    END IF;
END
$$;

-- The service role's grants, with the batch table (and its identity sequence).
CREATE OR REPLACE FUNCTION outbox.grant_service_role(role_name text) RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    EXECUTE format('GRANT USAGE ON SCHEMA outbox TO %I', role_name);
    EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON outbox.intent, outbox.resolution TO %I', role_name);
    EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON outbox.intent_history TO %I', role_name);
    EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON outbox.delivered_batch TO %I', role_name);
    EXECUTE format('GRANT SELECT ON outbox.all_intents TO %I', role_name);
    EXECUTE format('GRANT USAGE ON ALL SEQUENCES IN SCHEMA outbox TO %I', role_name);
    EXECUTE format('GRANT SELECT ON outbox.api_key TO %I', role_name);
    EXECUTE format('GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA outbox TO %I', role_name);
END;
$$;

-- Roles already granted (servers running now, or a grant made once out of band) get what
-- outbox.grant_service_role grants now: those that may delete intents, as the service role
-- does. A function, so that a later migration that grants something new calls it instead
-- of writing this loop again (migration 20261201000012 wrote it inline).
CREATE FUNCTION outbox.regrant_service_roles() RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    grantee text;
BEGIN
    FOR grantee IN
        SELECT DISTINCT pg_get_userbyid(a.grantee)::text
        FROM pg_class c, aclexplode(c.relacl) a
        WHERE c.oid = 'outbox.intent'::regclass
          AND a.privilege_type = 'DELETE'
          AND a.grantee <> c.relowner
          AND a.grantee <> 0
    LOOP
        PERFORM outbox.grant_service_role(grantee);
    END LOOP;
END;
$$;

SELECT outbox.regrant_service_roles();
