-- A request's tenants reach the row-level security policies as one comma-separated
-- setting (outbox.tenants), so a tenant name with a comma, written into api_key by hand,
-- would read as two tenants: the key would act for both. `outboxd keys` never writes one
-- (tenant names are checked); this refuses it from any writer, and an empty name too.
ALTER TABLE outbox.api_key
    ADD CONSTRAINT api_key_tenants_are_single_names CHECK (
        strpos(array_to_string(tenants, ''), ',') = 0 AND NOT ('' = ANY (tenants))
    );
