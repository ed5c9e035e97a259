-- Undoes …03_baseline_tenancy. The role outboxd_fleet stays: it belongs to the cluster,
-- and other databases may use it.
DROP FUNCTION outbox.grant_fleet_role(text);
DROP FUNCTION outbox.regrant_service_roles();
DROP FUNCTION outbox.grant_service_role(text);

REVOKE ALL ON ALL TABLES IN SCHEMA outbox FROM outboxd_fleet;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA outbox FROM outboxd_fleet;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA outbox FROM outboxd_fleet;
REVOKE ALL ON SCHEMA outbox FROM outboxd_fleet;
REVOKE USAGE ON SCHEMA outbox FROM PUBLIC;

DROP POLICY delivered_batch_fleet ON outbox.delivered_batch;
DROP POLICY delivered_batch_of_current_tenants ON outbox.delivered_batch;
ALTER TABLE outbox.delivered_batch NO FORCE ROW LEVEL SECURITY;
ALTER TABLE outbox.delivered_batch DISABLE ROW LEVEL SECURITY;

DROP POLICY resolution_fleet ON outbox.resolution;
DROP POLICY resolution_of_current_tenants ON outbox.resolution;
ALTER TABLE outbox.resolution NO FORCE ROW LEVEL SECURITY;
ALTER TABLE outbox.resolution DISABLE ROW LEVEL SECURITY;

DROP POLICY intent_fleet ON outbox.intent;
DROP POLICY intent_of_current_tenants ON outbox.intent;
ALTER TABLE outbox.intent NO FORCE ROW LEVEL SECURITY;
ALTER TABLE outbox.intent DISABLE ROW LEVEL SECURITY;

DROP FUNCTION outbox.enter_scope(text, text);
DROP FUNCTION outbox.cross_tenant();
DROP FUNCTION outbox.current_tenants();
DROP TABLE outbox.scope_secret;
