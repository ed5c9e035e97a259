DROP FUNCTION IF EXISTS outbox.txn_token();
