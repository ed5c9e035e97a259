-- Intents leased per minute, for the console's chart (docs/console.md): each replica that
-- serves the console counts what its Claims lease (its enqueues' hand-offs included) in
-- memory, by tenant, region and minute, and adds the counts here every second. A Claim
-- writes nothing more for it. Kept two hours.
CREATE TABLE outbox.claim_tally (
    minute timestamptz NOT NULL,
    tenant_id text NOT NULL,
    region text NOT NULL,
    claimed bigint NOT NULL,
    PRIMARY KEY (minute, tenant_id, region)
);

ALTER TABLE outbox.claim_tally ENABLE ROW LEVEL SECURITY;
ALTER TABLE outbox.claim_tally FORCE ROW LEVEL SECURITY;
CREATE POLICY claim_tally_of_current_tenants ON outbox.claim_tally
    USING (tenant_id = ANY ((SELECT v.tenants FROM outbox.verified_tenants v)::text[]))
    WITH CHECK (tenant_id = ANY ((SELECT v.tenants FROM outbox.verified_tenants v)::text[]));
CREATE POLICY claim_tally_fleet ON outbox.claim_tally TO outboxd_fleet
    USING (true) WITH CHECK (true);

CREATE OR REPLACE FUNCTION outbox.grant_service_role(role_name text) RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    EXECUTE format('GRANT USAGE ON SCHEMA outbox TO %I', role_name);
    EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON outbox.intent, outbox.resolution TO %I', role_name);
    EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON outbox.delivered_batch TO %I', role_name);
    EXECUTE format('GRANT SELECT, INSERT, UPDATE ON outbox.queue_level, outbox.queue_policy, outbox.queue_policy_change TO %I', role_name);
    EXECUTE format('GRANT SELECT ON outbox.all_intents TO %I', role_name);
    EXECUTE format('GRANT USAGE ON ALL SEQUENCES IN SCHEMA outbox TO %I', role_name);
    EXECUTE format('GRANT SELECT ON outbox.api_key TO %I', role_name);
    EXECUTE format('GRANT SELECT, INSERT, DELETE ON outbox.console_session TO %I', role_name);
    EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON outbox.claim_tally TO %I', role_name);
    EXECUTE format('GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA outbox TO %I', role_name);
END;
$$;

SELECT outbox.regrant_service_roles();
