-- Tenant isolation enforced by PostgreSQL, not by outboxd's WHERE clauses: with FORCE ROW
-- LEVEL SECURITY even the table owner is filtered, and outboxd connects as a role that owns
-- nothing. Each transaction says whom it acts for with set_config(…, true), which ends
-- with the transaction, so a pooled connection never carries a tenant over.

-- The tenants the current transaction may see ('outbox.tenants', comma-separated).
-- Unset means none: a code path that forgot to set it sees nothing (fails closed).
CREATE FUNCTION outbox.current_tenants() RETURNS text[]
LANGUAGE sql STABLE
AS $$ SELECT string_to_array(nullif(current_setting('outbox.tenants', true), ''), ',') $$;

-- Cross-tenant work (lease rescue, staged promotion, retention, all-tenant admin keys)
-- is granted explicitly per transaction with 'outbox.cross_tenant' = 'on'.
CREATE FUNCTION outbox.cross_tenant() RETURNS boolean
LANGUAGE sql STABLE
AS $$ SELECT coalesce(current_setting('outbox.cross_tenant', true), '') = 'on' $$;

ALTER TABLE outbox.intent ENABLE ROW LEVEL SECURITY;
ALTER TABLE outbox.intent FORCE ROW LEVEL SECURITY;
CREATE POLICY intent_of_current_tenants ON outbox.intent
    USING (tenant_id = ANY (outbox.current_tenants()))
    WITH CHECK (tenant_id = ANY (outbox.current_tenants()));
CREATE POLICY intent_cross_tenant ON outbox.intent
    USING (outbox.cross_tenant())
    WITH CHECK (outbox.cross_tenant());

ALTER TABLE outbox.resolution ENABLE ROW LEVEL SECURITY;
ALTER TABLE outbox.resolution FORCE ROW LEVEL SECURITY;
CREATE POLICY resolution_of_current_tenants ON outbox.resolution
    USING (tenant_id = ANY (outbox.current_tenants()))
    WITH CHECK (tenant_id = ANY (outbox.current_tenants()));
CREATE POLICY resolution_cross_tenant ON outbox.resolution
    USING (outbox.cross_tenant())
    WITH CHECK (outbox.cross_tenant());

-- API keys: only a SHA-256 of the secret is stored. Keys are looked up before the tenant
-- is known, so this table has no tenant policy; outboxd's role may read it and nothing else.
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
    CONSTRAINT api_key_has_tenants CHECK (all_tenants OR cardinality(tenants) > 0)
);

-- Producers in the outbox's database call outbox.txn_token(); nothing else is public.
GRANT USAGE ON SCHEMA outbox TO PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA outbox FROM PUBLIC;

-- Grants what the outboxd service role needs, now and for tables later migrations add.
-- Run by the schema owner: SELECT outbox.grant_service_role('outboxd');
CREATE FUNCTION outbox.grant_service_role(role_name text) RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    EXECUTE format('GRANT USAGE ON SCHEMA outbox TO %I', role_name);
    EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON outbox.intent, outbox.resolution TO %I', role_name);
    EXECUTE format('GRANT USAGE ON ALL SEQUENCES IN SCHEMA outbox TO %I', role_name);
    EXECUTE format('GRANT SELECT ON outbox.api_key TO %I', role_name);
    EXECUTE format('GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA outbox TO %I', role_name);
END;
$$;

REVOKE EXECUTE ON FUNCTION outbox.grant_service_role(text) FROM PUBLIC;
