-- The cross-tenant policies of migration 20261201000006 again (a setting, as before).
-- The role outboxd_fleet stays: it belongs to the cluster, and other databases may use it.
DROP FUNCTION outbox.grant_fleet_role(text);

CREATE OR REPLACE FUNCTION outbox.cross_tenant() RETURNS boolean
LANGUAGE sql STABLE
AS $$ SELECT coalesce(current_setting('outbox.cross_tenant', true), '') = 'on' $$;

DROP POLICY intent_fleet ON outbox.intent;
CREATE POLICY intent_cross_tenant ON outbox.intent
    USING ((SELECT outbox.cross_tenant()))
    WITH CHECK ((SELECT outbox.cross_tenant()));

DROP POLICY resolution_fleet ON outbox.resolution;
CREATE POLICY resolution_cross_tenant ON outbox.resolution
    USING ((SELECT outbox.cross_tenant()))
    WITH CHECK ((SELECT outbox.cross_tenant()));

DROP POLICY intent_history_fleet ON outbox.intent_history;
CREATE POLICY intent_history_cross_tenant ON outbox.intent_history
    USING ((SELECT outbox.cross_tenant()))
    WITH CHECK ((SELECT outbox.cross_tenant()));

DROP POLICY delivered_batch_fleet ON outbox.delivered_batch;
CREATE POLICY delivered_batch_cross_tenant ON outbox.delivered_batch
    USING ((SELECT outbox.cross_tenant()))
    WITH CHECK ((SELECT outbox.cross_tenant()));

REVOKE ALL ON ALL TABLES IN SCHEMA outbox FROM outboxd_fleet;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA outbox FROM outboxd_fleet;
REVOKE ALL ON SCHEMA outbox FROM outboxd_fleet;
