-- WAITING: an intent of an ordering key behind an earlier one of that key that has not
-- finished (migration …06 and docs/ordering.md). A migration of its own: a value added to
-- an enum cannot be used in the transaction that adds it.
ALTER TYPE outbox.intent_state ADD VALUE IF NOT EXISTS 'waiting' AFTER 'staged';
