CREATE INDEX intent_finished_at_idx ON outbox.intent (finished_at)
    WHERE state IN ('delivered', 'discarded');
DROP FUNCTION outbox.uuid_v7_floor(timestamptz);
