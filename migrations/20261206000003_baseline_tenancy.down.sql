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

DROP POLICY claim_request_fleet ON outbox.claim_request;
DROP POLICY claim_request_of_current_tenants ON outbox.claim_request;
ALTER TABLE outbox.claim_request NO FORCE ROW LEVEL SECURITY;
ALTER TABLE outbox.claim_request DISABLE ROW LEVEL SECURITY;

DROP POLICY claim_tally_fleet ON outbox.claim_tally;
DROP POLICY claim_tally_of_current_tenants ON outbox.claim_tally;
ALTER TABLE outbox.claim_tally NO FORCE ROW LEVEL SECURITY;
ALTER TABLE outbox.claim_tally DISABLE ROW LEVEL SECURITY;

DROP POLICY queue_policy_change_fleet ON outbox.queue_policy_change;
DROP POLICY queue_policy_change_of_current_tenants ON outbox.queue_policy_change;
ALTER TABLE outbox.queue_policy_change NO FORCE ROW LEVEL SECURITY;
ALTER TABLE outbox.queue_policy_change DISABLE ROW LEVEL SECURITY;

DROP POLICY queue_policy_fleet ON outbox.queue_policy;
DROP POLICY queue_policy_of_current_tenants ON outbox.queue_policy;
ALTER TABLE outbox.queue_policy NO FORCE ROW LEVEL SECURITY;
ALTER TABLE outbox.queue_policy DISABLE ROW LEVEL SECURITY;

DROP POLICY queue_level_fleet ON outbox.queue_level;
DROP POLICY queue_level_of_current_tenants ON outbox.queue_level;
ALTER TABLE outbox.queue_level NO FORCE ROW LEVEL SECURITY;
ALTER TABLE outbox.queue_level DISABLE ROW LEVEL SECURITY;

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
DROP VIEW outbox.verified_tenants;
DROP TABLE outbox.scope_secret;
