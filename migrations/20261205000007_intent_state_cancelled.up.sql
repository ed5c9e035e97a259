-- CANCELLED: an operator's decision that an intent not delivered yet never will be
-- (migration …08). A migration of its own: a value added to an enum cannot be used in the
-- transaction that adds it.
ALTER TYPE outbox.intent_state ADD VALUE IF NOT EXISTS 'cancelled' AFTER 'discarded';
