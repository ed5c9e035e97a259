-- intent_tenant_state_idx no longer holds LEASED and SUBMITTED rows. Holding them, it
-- matched the state test of every Ack, Fail, ExtendLease and MarkSubmitted, and since the
-- leased set is small whenever ANALYZE looks, the planner chose it over the primary key to
-- find each intent by id: a scan of the whole index per id, which grows with every lease
-- taken until vacuum (burn-down fell from ~40k to ~27k intents/s once the table was
-- analyzed). Leases are found through the primary key, and counted through
-- intent_lease_expires_at_idx; the index also costs one write less per claim.
DROP INDEX outbox.intent_tenant_state_idx;
CREATE INDEX intent_tenant_state_idx ON outbox.intent (tenant_id, state, id)
    WHERE state IN ('needs_reconcile', 'dead_lettered', 'staged');
