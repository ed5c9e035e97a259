-- Undoes …08: CANCELLED intents become DISCARDED (final, never delivered) and their
-- decisions DEAD, so that …01's constraints hold again.
UPDATE outbox.intent SET state = 'discarded' WHERE state = 'cancelled';
UPDATE outbox.resolution SET decision = 'dead' WHERE decision = 'cancel';

CREATE INDEX intent_finished_at_idx ON outbox.intent (finished_at)
    WHERE state IN ('delivered', 'discarded');
DROP INDEX outbox.intent_finished_idx;

ALTER TABLE outbox.intent
    DROP CONSTRAINT intent_finished_has_time,
    ADD CONSTRAINT intent_finished_has_time CHECK (
        state NOT IN ('delivered', 'discarded') OR finished_at IS NOT NULL
    );

ALTER TABLE outbox.resolution
    DROP CONSTRAINT resolution_decision_known,
    ADD CONSTRAINT resolution_decision_known
        CHECK (decision IN ('delivered', 'requeue', 'dead'));
