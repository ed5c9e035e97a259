DROP FUNCTION outbox.enter_scope(text, text);
CREATE FUNCTION outbox.enter_scope(tenants text, cross_tenant text) RETURNS void
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    PERFORM set_config('outbox.tenants', tenants, true),
            set_config('outbox.cross_tenant', cross_tenant, true);
END
$$;
SELECT outbox.regrant_service_roles();

CREATE OR REPLACE FUNCTION outbox.current_tenants() RETURNS text[]
LANGUAGE sql STABLE SECURITY INVOKER
AS $$ SELECT string_to_array(nullif(current_setting('outbox.tenants', true), ''), ',') $$;

DROP TABLE outbox.scope_secret;
