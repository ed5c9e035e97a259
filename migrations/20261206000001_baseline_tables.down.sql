-- Undoes …01_baseline_tables: every intent, decision, key and policy goes with it.
DROP TABLE outbox.claim_tally;
DROP TABLE outbox.console_session;
DROP TABLE outbox.api_key;
DROP TABLE outbox.claim_request;
DROP TABLE outbox.queue_policy_change;
DROP TABLE outbox.queue_policy;
DROP TABLE outbox.queue_level;
DROP VIEW outbox.all_intents;
DROP TABLE outbox.delivered_batch;
DROP TYPE outbox.delivered_intent_v1;
DROP TABLE outbox.resolution;
DROP SEQUENCE outbox.intent_order_seq;
DROP TABLE outbox.intent;
DROP TYPE outbox.intent_state;
DROP SCHEMA outbox;
