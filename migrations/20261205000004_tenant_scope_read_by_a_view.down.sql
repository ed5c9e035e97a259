-- Undoes …04: the policies call outbox.current_tenants() again, which reads the secret
-- itself, as …03_baseline_tenancy defined them.
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

ALTER POLICY intent_of_current_tenants ON outbox.intent
    USING (tenant_id = ANY ((SELECT outbox.current_tenants())::text[]))
    WITH CHECK (tenant_id = ANY ((SELECT outbox.current_tenants())::text[]));
ALTER POLICY resolution_of_current_tenants ON outbox.resolution
    USING (tenant_id = ANY ((SELECT outbox.current_tenants())::text[]))
    WITH CHECK (tenant_id = ANY ((SELECT outbox.current_tenants())::text[]));
ALTER POLICY delivered_batch_of_current_tenants ON outbox.delivered_batch
    USING (tenant_id = ANY ((SELECT outbox.current_tenants())::text[]))
    WITH CHECK (tenant_id = ANY ((SELECT outbox.current_tenants())::text[]));

DROP VIEW outbox.verified_tenants;
