-- Undoes …01_baseline_tables: every intent, decision and key goes with it.
DROP VIEW outbox.all_intents;
DROP TABLE outbox.delivered_batch;
DROP TYPE outbox.delivered_intent_v1;
DROP TABLE outbox.api_key;
DROP TABLE outbox.resolution;
DROP TABLE outbox.intent;
DROP TYPE outbox.intent_state;
DROP SCHEMA outbox;
