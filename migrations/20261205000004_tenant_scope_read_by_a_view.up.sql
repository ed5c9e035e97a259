-- The policies read the proven tenants from a view instead of calling
-- outbox.current_tenants(). The function (PL/pgSQL, SECURITY DEFINER, a statement of its
-- own over the secret) cost 30-100 µs per call, and a policy calls it once per use in a
-- statement: three times per claim, twice per Ack, ~0.4 ms of PostgreSQL per claim and
-- Ack of 100 (+12% in the burn-down). Read through a view, the same check is an InitPlan
-- of one index scan in the statement's own plan (~10 µs).
--
-- The view runs with its owner's privileges, who may read the secret; callers may read
-- only its one column, the tenant list of the transaction if 'outbox.scope_proof' proves
-- it (as before: hex(sha256(secret || sha256(secret || tenants)))), and no row otherwise.
-- security_barrier: no condition of a caller's query runs before the view's own, so
-- nothing a caller writes ever sees the secret. `s.singleton` lets the scan use the
-- primary key where the claim and settle functions turn sequential scans off.
CREATE VIEW outbox.verified_tenants WITH (security_barrier) AS
SELECT string_to_array(nullif(current_setting('outbox.tenants', true), ''), ',') AS tenants
FROM outbox.scope_secret s
WHERE s.singleton
  AND current_setting('outbox.scope_proof', true)
      = encode(sha256(s.secret || sha256(s.secret
                                         || convert_to(current_setting('outbox.tenants', true),
                                                       'UTF8'))),
               'hex');
-- Everyone may read it, as everyone could always call outbox.current_tenants() (functions
-- are PUBLIC's to execute): it shows a caller only the list its own proof proves, and the
-- policies of every role read it.
GRANT SELECT ON outbox.verified_tenants TO PUBLIC;

-- The function stays for tools and tests, reading the same view.
CREATE OR REPLACE FUNCTION outbox.current_tenants() RETURNS text[]
LANGUAGE sql STABLE
AS $$ SELECT v.tenants FROM outbox.verified_tenants v $$;

-- As in …03_baseline_tenancy: a scalar subquery, evaluated once per statement.
ALTER POLICY intent_of_current_tenants ON outbox.intent
    USING (tenant_id = ANY ((SELECT v.tenants FROM outbox.verified_tenants v)::text[]))
    WITH CHECK (tenant_id = ANY ((SELECT v.tenants FROM outbox.verified_tenants v)::text[]));
ALTER POLICY resolution_of_current_tenants ON outbox.resolution
    USING (tenant_id = ANY ((SELECT v.tenants FROM outbox.verified_tenants v)::text[]))
    WITH CHECK (tenant_id = ANY ((SELECT v.tenants FROM outbox.verified_tenants v)::text[]));
ALTER POLICY delivered_batch_of_current_tenants ON outbox.delivered_batch
    USING (tenant_id = ANY ((SELECT v.tenants FROM outbox.verified_tenants v)::text[]))
    WITH CHECK (tenant_id = ANY ((SELECT v.tenants FROM outbox.verified_tenants v)::text[]));
