DROP INDEX outbox.intent_tenant_state_idx;
CREATE INDEX intent_tenant_state_idx ON outbox.intent (tenant_id, state, id)
    WHERE state IN ('needs_reconcile', 'dead_lettered', 'staged', 'leased', 'submitted');
