-- The row-level security policies read the transaction's tenant settings once per
-- statement instead of once per row. Written as plain calls, outbox.current_tenants() and
-- outbox.cross_tenant() ran for every row a statement looked at (current_setting, then
-- string_to_array): 13% of PostgreSQL's CPU in a burn-down, spent re-reading two settings
-- that cannot change within a statement. Wrapped in a scalar subquery, each becomes an
-- InitPlan the executor evaluates once and reuses. What the policies allow is unchanged.
ALTER POLICY intent_of_current_tenants ON outbox.intent
    USING (tenant_id = ANY ((SELECT outbox.current_tenants())::text[]))
    WITH CHECK (tenant_id = ANY ((SELECT outbox.current_tenants())::text[]));
ALTER POLICY intent_cross_tenant ON outbox.intent
    USING ((SELECT outbox.cross_tenant()))
    WITH CHECK ((SELECT outbox.cross_tenant()));

ALTER POLICY resolution_of_current_tenants ON outbox.resolution
    USING (tenant_id = ANY ((SELECT outbox.current_tenants())::text[]))
    WITH CHECK (tenant_id = ANY ((SELECT outbox.current_tenants())::text[]));
ALTER POLICY resolution_cross_tenant ON outbox.resolution
    USING ((SELECT outbox.cross_tenant()))
    WITH CHECK ((SELECT outbox.cross_tenant()));
