-- Operator decisions record the API key that made them beside the actor it named: the
-- actor is the caller's word (the CLI's --actor), the key is what outboxd authenticated.
-- NULL for decisions recorded before.
ALTER TABLE outbox.resolution ADD COLUMN api_key text;
ALTER TABLE outbox.queue_policy ADD COLUMN updated_by_key text;
ALTER TABLE outbox.queue_policy_change ADD COLUMN api_key text;
