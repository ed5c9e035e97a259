-- Tenant isolation: the fleet role, the transaction's proven scope, row-level security and
-- the grants (docs/tenancy.md).
--
-- Isolation is enforced by PostgreSQL, not by outboxd's WHERE clauses. With FORCE ROW LEVEL
-- SECURITY even the tables' owner is filtered, and outboxd serves requests through a role
-- that owns nothing. A transaction of that role says whom it acts for with
-- set_config('outbox.tenants', …, true), which ends with the transaction, so a pooled
-- connection never carries a tenant over; and proves it with 'outbox.scope_proof', a keyed
-- hash of that list under a secret the role cannot read, so that naming a tenant is not
-- enough. Work for every tenant (lease rescue, retention, staged promotion, queue gauges,
-- keys bound to all tenants) runs on a second pool, as a member of the role outboxd_fleet:
-- only that grant opens every tenant, so nothing a session of the request-serving role
-- sets can (outboxd refuses to serve through a role that is, or could make itself, a
-- member).

-- The fleet role. Roles belong to the cluster, not to a database: created only if missing,
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

-- Producers in the outbox's database call outbox.txn_token(); no table is public (the view
-- outbox.verified_tenants below is granted to everyone on purpose).
GRANT USAGE ON SCHEMA outbox TO PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA outbox FROM PUBLIC;

-- ---------------------------------------------------------------------------------------
-- The transaction's proven scope
-- ---------------------------------------------------------------------------------------

-- A table, a view and functions, here rather than in …01_baseline_tables and
-- …02_baseline_functions: they exist for tenancy alone, the policies below read the view,
-- and outbox.current_tenants (a SQL function, checked when it is created) reads the view,
-- which reads the secret.

-- The key of the scope proofs: one row, made here from PostgreSQL's strong random source
-- (366 random bits hashed down to 256). Readable by its owner and outboxd_fleet only;
-- outboxd reads it once at start through its fleet pool.
CREATE TABLE outbox.scope_secret (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    secret bytea NOT NULL CHECK (length(secret) >= 32)
);
INSERT INTO outbox.scope_secret (secret)
SELECT sha256(convert_to(gen_random_uuid()::text || gen_random_uuid()::text
                         || gen_random_uuid()::text, 'UTF8'));
REVOKE ALL ON outbox.scope_secret FROM PUBLIC;
GRANT SELECT ON outbox.scope_secret TO outboxd_fleet;

-- The proven tenants of the current transaction: 'outbox.tenants' (comma-separated; a
-- tenant name never holds a comma, see api_key_tenants_are_single_names) if
-- 'outbox.scope_proof' is its proof, hex(sha256(secret || sha256(secret || tenants))) (the
-- nesting so that no proof extends to a longer list); otherwise no row, no tenant. Unset, a
-- wrong, missing or borrowed proof: nothing visible (fails closed).
--
-- A view, not a function, because the policies read it: a PL/pgSQL SECURITY DEFINER
-- function with a statement of its own over the secret cost 30-100 µs per call, and a
-- policy calls it once per use in a statement (three times per claim, twice per Ack, ~0.4
-- ms of PostgreSQL per claim and Ack of 100, +12% in the burn-down). Read through a view,
-- the same check is an InitPlan of one index scan in the statement's own plan (~10 µs).
--
-- The view runs with its owner's privileges, who may read the secret; callers may read
-- only its one column, the tenant list of the transaction if 'outbox.scope_proof' proves
-- it, and no row otherwise. security_barrier: no condition of a caller's query runs before
-- the view's own, so nothing a caller writes ever sees the secret. `s.singleton` lets the
-- scan use the primary key where the claim and settle functions turn sequential scans off.
CREATE VIEW outbox.verified_tenants WITH (security_barrier) AS
SELECT string_to_array(nullif(current_setting('outbox.tenants', true), ''), ',') AS tenants
FROM outbox.scope_secret s
WHERE s.singleton
  AND current_setting('outbox.scope_proof', true)
      = encode(sha256(s.secret || sha256(s.secret
                                         || convert_to(current_setting('outbox.tenants', true),
                                                       'UTF8'))),
               'hex');
-- Everyone may read it, as everyone may call outbox.current_tenants() (functions are
-- PUBLIC's to execute): it shows a caller only the list its own proof proves, and the
-- policies of every role read it.
GRANT SELECT ON outbox.verified_tenants TO PUBLIC;

-- The same list, for tools and tests.
CREATE FUNCTION outbox.current_tenants() RETURNS text[]
LANGUAGE sql STABLE
AS $$ SELECT v.tenants FROM outbox.verified_tenants v $$;

-- Whether the session sees every tenant: it acts as a member of outboxd_fleet. No policy
-- reads it (the fleet policies are granted to the role); it is for tools and tests.
CREATE FUNCTION outbox.cross_tenant() RETURNS boolean
LANGUAGE sql STABLE
AS $$ SELECT pg_has_role(current_user, 'outboxd_fleet', 'USAGE') $$;

-- Scopes the current transaction to `tenants` (comma-separated), proven by `scope_proof`,
-- as outboxd's BEGIN does: what the one-round-trip functions of …02_baseline_functions
-- call first, with their second argument (the fleet's scope, every tenant, is its role's
-- grant, and passes ''). PL/pgSQL, not SQL: a SQL function called from PL/pgSQL is planned
-- again on every call (53 µs a call, measured), a PL/pgSQL one once per connection.
CREATE FUNCTION outbox.enter_scope(tenants text, scope_proof text) RETURNS void
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    PERFORM set_config('outbox.tenants', tenants, true),
            set_config('outbox.scope_proof', scope_proof, true);
END
$$;

-- ---------------------------------------------------------------------------------------
-- Row-level security
-- ---------------------------------------------------------------------------------------

-- Every table holding tenants' rows has two policies: its rows of the transaction's
-- tenants, for everyone, and every row, for outboxd_fleet. The tenant list is read in a
-- scalar subquery: an InitPlan the executor evaluates once per statement. Written as a
-- plain call, a function reading it ran for every row a statement looked at (13% of
-- PostgreSQL's CPU in a burn-down).
ALTER TABLE outbox.intent ENABLE ROW LEVEL SECURITY;
ALTER TABLE outbox.intent FORCE ROW LEVEL SECURITY;
CREATE POLICY intent_of_current_tenants ON outbox.intent
    USING (tenant_id = ANY ((SELECT v.tenants FROM outbox.verified_tenants v)::text[]))
    WITH CHECK (tenant_id = ANY ((SELECT v.tenants FROM outbox.verified_tenants v)::text[]));
CREATE POLICY intent_fleet ON outbox.intent TO outboxd_fleet USING (true) WITH CHECK (true);

ALTER TABLE outbox.resolution ENABLE ROW LEVEL SECURITY;
ALTER TABLE outbox.resolution FORCE ROW LEVEL SECURITY;
CREATE POLICY resolution_of_current_tenants ON outbox.resolution
    USING (tenant_id = ANY ((SELECT v.tenants FROM outbox.verified_tenants v)::text[]))
    WITH CHECK (tenant_id = ANY ((SELECT v.tenants FROM outbox.verified_tenants v)::text[]));
CREATE POLICY resolution_fleet ON outbox.resolution TO outboxd_fleet
    USING (true) WITH CHECK (true);

ALTER TABLE outbox.delivered_batch ENABLE ROW LEVEL SECURITY;
ALTER TABLE outbox.delivered_batch FORCE ROW LEVEL SECURITY;
CREATE POLICY delivered_batch_of_current_tenants ON outbox.delivered_batch
    USING (tenant_id = ANY ((SELECT v.tenants FROM outbox.verified_tenants v)::text[]))
    WITH CHECK (tenant_id = ANY ((SELECT v.tenants FROM outbox.verified_tenants v)::text[]));
CREATE POLICY delivered_batch_fleet ON outbox.delivered_batch TO outboxd_fleet
    USING (true) WITH CHECK (true);

ALTER TABLE outbox.queue_level ENABLE ROW LEVEL SECURITY;
ALTER TABLE outbox.queue_level FORCE ROW LEVEL SECURITY;
CREATE POLICY queue_level_of_current_tenants ON outbox.queue_level
    USING (tenant_id = ANY ((SELECT v.tenants FROM outbox.verified_tenants v)::text[]))
    WITH CHECK (tenant_id = ANY ((SELECT v.tenants FROM outbox.verified_tenants v)::text[]));
CREATE POLICY queue_level_fleet ON outbox.queue_level TO outboxd_fleet
    USING (true) WITH CHECK (true);

ALTER TABLE outbox.queue_policy ENABLE ROW LEVEL SECURITY;
ALTER TABLE outbox.queue_policy FORCE ROW LEVEL SECURITY;
CREATE POLICY queue_policy_of_current_tenants ON outbox.queue_policy
    USING (tenant_id = ANY ((SELECT v.tenants FROM outbox.verified_tenants v)::text[]))
    WITH CHECK (tenant_id = ANY ((SELECT v.tenants FROM outbox.verified_tenants v)::text[]));
CREATE POLICY queue_policy_fleet ON outbox.queue_policy TO outboxd_fleet
    USING (true) WITH CHECK (true);

ALTER TABLE outbox.queue_policy_change ENABLE ROW LEVEL SECURITY;
ALTER TABLE outbox.queue_policy_change FORCE ROW LEVEL SECURITY;
CREATE POLICY queue_policy_change_of_current_tenants ON outbox.queue_policy_change
    USING (tenant_id = ANY ((SELECT v.tenants FROM outbox.verified_tenants v)::text[]))
    WITH CHECK (tenant_id = ANY ((SELECT v.tenants FROM outbox.verified_tenants v)::text[]));
CREATE POLICY queue_policy_change_fleet ON outbox.queue_policy_change TO outboxd_fleet
    USING (true) WITH CHECK (true);

ALTER TABLE outbox.claim_tally ENABLE ROW LEVEL SECURITY;
ALTER TABLE outbox.claim_tally FORCE ROW LEVEL SECURITY;
CREATE POLICY claim_tally_of_current_tenants ON outbox.claim_tally
    USING (tenant_id = ANY ((SELECT v.tenants FROM outbox.verified_tenants v)::text[]))
    WITH CHECK (tenant_id = ANY ((SELECT v.tenants FROM outbox.verified_tenants v)::text[]));
CREATE POLICY claim_tally_fleet ON outbox.claim_tally TO outboxd_fleet
    USING (true) WITH CHECK (true);

-- A claim's replay row belongs to the scope that claimed: visible only to a scope that
-- proves all of its tenants (a fleet claim's row, with none, to the fleet alone).
ALTER TABLE outbox.claim_request ENABLE ROW LEVEL SECURITY;
ALTER TABLE outbox.claim_request FORCE ROW LEVEL SECURITY;
CREATE POLICY claim_request_of_current_tenants ON outbox.claim_request
    USING (cardinality(scope_tenants) > 0
           AND scope_tenants <@ (SELECT v.tenants FROM outbox.verified_tenants v)::text[])
    WITH CHECK (cardinality(scope_tenants) > 0
                AND scope_tenants <@ (SELECT v.tenants FROM outbox.verified_tenants v)::text[]);
CREATE POLICY claim_request_fleet ON outbox.claim_request TO outboxd_fleet
    USING (true) WITH CHECK (true);

-- outbox.api_key and outbox.console_session have no tenant policy: keys are looked up
-- before the tenant is known, and a session is found by its token's hash.

-- ---------------------------------------------------------------------------------------
-- Grants
-- ---------------------------------------------------------------------------------------

-- Grants what outboxd's roles need. Run by the schema owner for the request-serving role
-- (`SELECT outbox.grant_service_role('outboxd')`; outboxd does it itself when it migrates
-- at start), and below for outboxd_fleet. UPDATE on the batch history only for the purge's
-- FOR UPDATE SKIP LOCKED: no statement updates it. Console sessions: SELECT (to find one)
-- and DELETE (to end one), never INSERT: they are opened by outbox.open_console_session
-- alone (…02_baseline_functions says why).
CREATE FUNCTION outbox.grant_service_role(role_name text) RETURNS void
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
    EXECUTE format('GRANT SELECT, DELETE ON outbox.console_session TO %I', role_name);
    EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON outbox.claim_tally TO %I', role_name);
    EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON outbox.claim_request TO %I', role_name);
    EXECUTE format('GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA outbox TO %I', role_name);
END;
$$;

REVOKE EXECUTE ON FUNCTION outbox.grant_service_role(text) FROM PUBLIC;

-- Gives every role already granted (those that may delete intents, as the service role
-- and the fleet may) what outbox.grant_service_role grants now. A later migration that
-- adds a table or a function, or changes that function, ends with
-- `SELECT outbox.regrant_service_roles();`, so that no running server finds a call
-- refused after an upgrade nobody re-granted for.
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

-- What the service role may do to the tables, the fleet may do too (its policies let it do
-- so for every tenant).
SELECT outbox.grant_service_role('outboxd_fleet');

-- Every table under row-level security has its fleet policy, and no policy reads a setting
-- that opens other tenants: a table added later without one fails here, not in production.
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
        RAISE EXCEPTION 'policies reading outbox.cross_tenant: %', missing;
    END IF;
END
$$;
