ALTER POLICY intent_of_current_tenants ON outbox.intent
    USING (tenant_id = ANY (outbox.current_tenants()))
    WITH CHECK (tenant_id = ANY (outbox.current_tenants()));
ALTER POLICY intent_cross_tenant ON outbox.intent
    USING (outbox.cross_tenant())
    WITH CHECK (outbox.cross_tenant());

ALTER POLICY resolution_of_current_tenants ON outbox.resolution
    USING (tenant_id = ANY (outbox.current_tenants()))
    WITH CHECK (tenant_id = ANY (outbox.current_tenants()));
ALTER POLICY resolution_cross_tenant ON outbox.resolution
    USING (outbox.cross_tenant())
    WITH CHECK (outbox.cross_tenant());
