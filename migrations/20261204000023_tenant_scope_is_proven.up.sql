-- A transaction's tenants are proven to PostgreSQL, no longer just named.
--
-- Until now the tenant policies trusted the setting 'outbox.tenants', which any session
-- may set: the request-serving role could name any one tenant it knew, so a bug or an
-- injected statement in outboxd could read and write that tenant. Now a scope counts only
-- with its proof, 'outbox.scope_proof': a keyed hash of the tenant list under a secret
-- the request-serving role cannot read (outbox.scope_secret is readable by its owner and
-- by outboxd_fleet; outboxd reads it once at start through its fleet pool). A wrong,
-- missing or borrowed proof shows no tenant (fails closed). outboxd binds the proof as a
-- statement parameter, never as SQL text, so no pg_stat_activity row carries it.

CREATE TABLE outbox.scope_secret (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    secret bytea NOT NULL CHECK (length(secret) >= 32)
);
-- 366 random bits from PostgreSQL's strong random source, hashed down to 256.
INSERT INTO outbox.scope_secret (secret)
SELECT sha256(convert_to(gen_random_uuid()::text || gen_random_uuid()::text
                         || gen_random_uuid()::text, 'UTF8'));
REVOKE ALL ON outbox.scope_secret FROM PUBLIC;
GRANT SELECT ON outbox.scope_secret TO outboxd_fleet;

-- The proven tenants of the current transaction; NULL (no tenant) unless 'outbox.scope_proof'
-- is the proof of 'outbox.tenants': hex(sha256(secret || sha256(secret || tenants))), the
-- nesting so that no proof extends to a longer list. As its owner, which may read the
-- secret; PL/pgSQL, so its statement is planned once per connection (the policies call it
-- once per statement, as an InitPlan). Its search_path is fixed: it runs with its owner's
-- privileges.
CREATE OR REPLACE FUNCTION outbox.current_tenants() RETURNS text[]
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    tenants text := nullif(current_setting('outbox.tenants', true), '');
    proof text := current_setting('outbox.scope_proof', true);
BEGIN
    IF tenants IS NULL OR proof IS NULL THEN
        RETURN NULL;
    END IF;
    RETURN (
        SELECT string_to_array(tenants, ',')
        FROM outbox.scope_secret s
        WHERE proof = encode(sha256(s.secret || sha256(s.secret || convert_to(tenants, 'UTF8'))),
                             'hex')
    );
END
$$;

-- Scopes the current transaction to `tenants` (comma-separated), proven by `scope_proof`.
-- The functions that call it still name their second argument `cross_tenant`; it carries
-- the proof (the fleet's scope, every tenant, is its role's grant, and passes '').
DROP FUNCTION outbox.enter_scope(text, text);
CREATE FUNCTION outbox.enter_scope(tenants text, scope_proof text) RETURNS void
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    PERFORM set_config('outbox.tenants', tenants, true),
            set_config('outbox.scope_proof', scope_proof, true);
END
$$;
SELECT outbox.regrant_service_roles();
