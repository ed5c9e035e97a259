-- The operator's CANCEL (docs/design.md, "Reconcile"): STAGED, WAITING or PENDING intents
-- become CANCELLED, final, recorded in outbox.resolution as any decision; the retention
-- purges them with the delivered and discarded ones.
ALTER TABLE outbox.resolution
    DROP CONSTRAINT resolution_decision_known,
    ADD CONSTRAINT resolution_decision_known
        CHECK (decision IN ('delivered', 'requeue', 'dead', 'cancel'));

ALTER TABLE outbox.intent
    DROP CONSTRAINT intent_finished_has_time,
    ADD CONSTRAINT intent_finished_has_time CHECK (
        state NOT IN ('delivered', 'discarded', 'cancelled') OR finished_at IS NOT NULL
    );

-- Retention purges finished rows oldest first (…01's index, with CANCELLED).
CREATE INDEX intent_finished_idx ON outbox.intent (finished_at)
    WHERE state IN ('delivered', 'discarded', 'cancelled');
DROP INDEX outbox.intent_finished_at_idx;
