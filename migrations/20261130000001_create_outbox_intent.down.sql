DROP TABLE IF EXISTS outbox.resolution;
DROP TABLE IF EXISTS outbox.intent;
DROP TYPE IF EXISTS outbox.intent_state;
DROP SCHEMA IF EXISTS outbox;
