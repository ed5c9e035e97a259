-- Delivered intents leave the hot table. Until now Ack marked each intent DELIVERED in
-- place: a new row version in outbox.intent, with entries in its primary key and in the
-- purge's finished_at index, kept among the live intents for the whole retention. Every
-- claim and every settle then read a table, and a primary key, mostly made of history,
-- and vacuum kept walking it. Now Ack moves an intent it delivers into
-- outbox.intent_history, a table of its own, appended to in finishing order, that only
-- GetIntent, ListIntents, queue statistics, lost-response lookups and the purge read.
-- In pgbench, with outboxd's claim, the claim-and-ack loop's ceiling rose by 5-23%
-- (median 16%); the claim itself got faster too, its table staying small.
--
-- Intents with an idempotency key stay where they are, DELIVERED in place: the unique
-- index on (tenant_id, idempotency_key) over outbox.intent is what makes a key's second
-- Enqueue find the first one, and a guard spanning two tables would race with the move.
-- So do intents an operator resolves as delivered, and DISCARDED ones (a producer's
-- rollback): rare, and purged from outbox.intent as before.
--
-- During a rolling upgrade, servers of the previous release keep calling outbox.ack
-- (unchanged: it marks in place) and read outbox.intent only: until they are replaced,
-- their GetIntent answers NOT_FOUND for an intent a new server moved, and a replayed Ack
-- they receive for one gets a per-item NOT_FOUND. Nothing is lost; new servers read and
-- purge both tables.
--
-- outbox.intent_history has outbox.intent's columns, in its order (a migration that adds
-- a column to one adds it to both, and to outbox.all_intents), the same row-level
-- security (as migration 20261201000006 writes it), and two indexes: the primary key,
-- and finished_at for the purge.

CREATE TABLE outbox.intent_history (
    LIKE outbox.intent INCLUDING DEFAULTS INCLUDING CONSTRAINTS,
    PRIMARY KEY (id),
    CONSTRAINT intent_history_is_delivered CHECK (state = 'delivered')
);

-- Retention purges oldest first.
CREATE INDEX intent_history_finished_at_idx ON outbox.intent_history (finished_at);

ALTER TABLE outbox.intent_history ENABLE ROW LEVEL SECURITY;
ALTER TABLE outbox.intent_history FORCE ROW LEVEL SECURITY;
CREATE POLICY intent_history_of_current_tenants ON outbox.intent_history
    USING (tenant_id = ANY ((SELECT outbox.current_tenants())::text[]))
    WITH CHECK (tenant_id = ANY ((SELECT outbox.current_tenants())::text[]));
CREATE POLICY intent_history_cross_tenant ON outbox.intent_history
    USING ((SELECT outbox.cross_tenant()))
    WITH CHECK ((SELECT outbox.cross_tenant()));

-- Every intent, wherever it lives: what reads must find a delivered intent read this.
-- security_invoker: the tables' policies apply to the caller, not to the view's owner
-- (who may be a superuser, and bypass them).
CREATE VIEW outbox.all_intents WITH (security_invoker = true) AS
    SELECT * FROM outbox.intent
    UNION ALL
    SELECT * FROM outbox.intent_history;

-- The service role's grants, with the new table and view. UPDATE on the history only for
-- the purge's FOR UPDATE SKIP LOCKED (which needs it): no statement of outboxd updates it.
CREATE OR REPLACE FUNCTION outbox.grant_service_role(role_name text) RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    EXECUTE format('GRANT USAGE ON SCHEMA outbox TO %I', role_name);
    EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON outbox.intent, outbox.resolution TO %I', role_name);
    EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON outbox.intent_history TO %I', role_name);
    EXECUTE format('GRANT SELECT ON outbox.all_intents TO %I', role_name);
    EXECUTE format('GRANT USAGE ON ALL SEQUENCES IN SCHEMA outbox TO %I', role_name);
    EXECUTE format('GRANT SELECT ON outbox.api_key TO %I', role_name);
    EXECUTE format('GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA outbox TO %I', role_name);
END;
$$;

-- Roles already granted (servers running now, or a grant made once out of band, as the
-- Helm chart's migration hook expects) get the new table and view here: a new server must
-- not find its Ack refused after an upgrade nobody re-granted for.
DO $$
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
END
$$;

-- Ack (migration 20261201000009's outbox.ack, which servers of the previous release keep
-- calling during a rolling upgrade): `intent_ids[k]` under lease `lease_ids[k]`, from a
-- live lease or the last lease of a NEEDS_RECONCILE intent. Moves each such intent
-- without an idempotency key into outbox.intent_history, DELIVERED; marks the others
-- DELIVERED in place (outbox.ack itself), run only when some item was not moved (a keyed
-- intent, a lost lease, a replay). Returns the intents it delivered. Planned once
-- per connection as primary-key lookups over the batch, as outbox.ack is.
CREATE FUNCTION outbox.ack_into_history(
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
SET enable_hashjoin = off
SET enable_mergejoin = off
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
        )
        INSERT INTO outbox.intent_history AS h (
            id, tenant_id, kind, region, payload, content_type, headers, idempotency_key,
            state, attempts, max_attempts, available_at, created_at, updated_at, lease_id,
            lease_expires_at, worker_id, claim_request_id, last_error, finished_at, txn_xid
        )
        SELECT d.id, d.tenant_id, d.kind, d.region, d.payload, d.content_type, d.headers,
               NULL, 'delivered', d.attempts, d.max_attempts, d.available_at, d.created_at,
               delivered_at, d.lease_id, NULL, d.worker_id, NULL, d.last_error,
               delivered_at, d.txn_xid
        FROM delivered d
        RETURNING h.id, h.state, h.lease_expires_at, h.headers->>'traceparent';
    GET DIAGNOSTICS moved = ROW_COUNT;
    IF moved < cardinality(intent_ids) THEN
        -- What is left (keyed intents, lost leases, replays) is outbox.ack's: in place.
        RETURN QUERY
            SELECT * FROM outbox.ack(tenants, cross_tenant, intent_ids, lease_ids, delivered_at);
    END IF;
END
$$;
