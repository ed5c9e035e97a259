-- Undoes …06_decisions_record_their_api_key.
ALTER TABLE outbox.queue_policy_change DROP COLUMN api_key;
ALTER TABLE outbox.queue_policy DROP COLUMN updated_by_key;
ALTER TABLE outbox.resolution DROP COLUMN api_key;
