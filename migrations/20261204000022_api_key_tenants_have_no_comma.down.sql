ALTER TABLE outbox.api_key DROP CONSTRAINT api_key_tenants_are_single_names;
