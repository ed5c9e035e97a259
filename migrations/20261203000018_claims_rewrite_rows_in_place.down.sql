ALTER TABLE outbox.intent RESET (fillfactor);
