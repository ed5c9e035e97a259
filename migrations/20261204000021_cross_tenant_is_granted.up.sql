-- Cross-tenant access is granted to a role, no longer declared by the session.
--
-- Until now the cross-tenant policies of every tenant table trusted outbox.cross_tenant(),
-- that is the setting 'outbox.cross_tenant', which any session may set: outboxd's own
-- request-serving role could switch it on in any transaction, so a bug or an injected
-- statement in outboxd read and wrote every tenant. Now only members of the role
-- outboxd_fleet see every tenant (policies `TO outboxd_fleet`), and the request-serving
-- role is not one (outboxd refuses to serve through a role that is, or that could make
-- itself one): nothing a session of that role sets opens another tenant. outboxd holds a
-- second pool, connected as a member of outboxd_fleet, for the work of every tenant (lease
-- rescue, retention, staged promotion, queue gauges, API keys bound to all tenants); see
-- docs/tenancy.md.
--
-- Roles belong to the cluster, not to a database: the role is created only if missing,
-- and a migrating role that may not create it is told who must.

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outboxd_fleet') THEN
        BEGIN
            CREATE ROLE outboxd_fleet NOLOGIN;
        EXCEPTION
            -- Another database of the cluster migrating at the same time created it.
            WHEN duplicate_object OR unique_violation THEN NULL;
            WHEN insufficient_privilege THEN
                RAISE EXCEPTION 'the role outboxd_fleet does not exist, and % may not create it',
                    current_user
                    USING HINT = 'Once per PostgreSQL cluster, as a superuser or a role with '
                        'CREATEROLE: CREATE ROLE outboxd_fleet NOLOGIN; then migrate again '
                        '(see docs/tenancy.md).';
        END;
    END IF;
END
$$;

-- What the service role may do to the tables, the fleet may do too (and what later
-- migrations grant: outbox.regrant_service_roles() finds it by its DELETE on outbox.intent).
SELECT outbox.grant_service_role('outboxd_fleet');

-- The cross-tenant policies: a grant, not a setting.
DROP POLICY intent_cross_tenant ON outbox.intent;
CREATE POLICY intent_fleet ON outbox.intent TO outboxd_fleet USING (true) WITH CHECK (true);

DROP POLICY resolution_cross_tenant ON outbox.resolution;
CREATE POLICY resolution_fleet ON outbox.resolution TO outboxd_fleet
    USING (true) WITH CHECK (true);

DROP POLICY intent_history_cross_tenant ON outbox.intent_history;
CREATE POLICY intent_history_fleet ON outbox.intent_history TO outboxd_fleet
    USING (true) WITH CHECK (true);

DROP POLICY delivered_batch_cross_tenant ON outbox.delivered_batch;
CREATE POLICY delivered_batch_fleet ON outbox.delivered_batch TO outboxd_fleet
    USING (true) WITH CHECK (true);

-- Whether the session sees every tenant: it acts as a member of outboxd_fleet. No policy
-- reads it any more; it stays for tools, and for what called it before. The setting
-- 'outbox.cross_tenant' (still set by outbox.enter_scope, whose callers pass it) opens
-- nothing.
CREATE OR REPLACE FUNCTION outbox.cross_tenant() RETURNS boolean
LANGUAGE sql STABLE
AS $$ SELECT pg_has_role(current_user, 'outboxd_fleet', 'USAGE') $$;

-- Makes `role_name` (a login role, for outboxd's fleet pool) a member of outboxd_fleet,
-- unless it already has the fleet's privileges. Run by a role that may grant outboxd_fleet
-- (a superuser, its creator with CREATEROLE): it runs as its caller, so the service role,
-- which may execute every function of the schema, cannot use it to grant itself.
CREATE FUNCTION outbox.grant_fleet_role(role_name text) RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    IF NOT pg_has_role(role_name, 'outboxd_fleet', 'USAGE') THEN
        EXECUTE format('GRANT outboxd_fleet TO %I', role_name);
    END IF;
END;
$$;

REVOKE EXECUTE ON FUNCTION outbox.grant_fleet_role(text) FROM PUBLIC;

-- Every table under row-level security has its fleet policy, and no policy is left that
-- a setting could open: a table added later without one fails here, not in production.
DO $$
DECLARE
    missing text;
BEGIN
    SELECT string_agg(c.relname, ', ') INTO missing
    FROM pg_class c
    WHERE c.relnamespace = 'outbox'::regnamespace
      AND c.relrowsecurity
      AND NOT EXISTS (
          SELECT 1 FROM pg_policy p
          WHERE p.polrelid = c.oid AND 'outboxd_fleet'::regrole::oid = ANY (p.polroles)
      );
    IF missing IS NOT NULL THEN
        RAISE EXCEPTION 'tables without a policy for outboxd_fleet: %', missing;
    END IF;
    SELECT string_agg(policyname, ', ') INTO missing
    FROM pg_policies
    WHERE schemaname = 'outbox'
      AND (coalesce(qual, '') || coalesce(with_check, '')) LIKE '%cross_tenant%';
    IF missing IS NOT NULL THEN
        RAISE EXCEPTION 'policies still reading outbox.cross_tenant: %', missing;
    END IF;
END
$$;
