CREATE OR REPLACE FUNCTION outbox.queues_within_their_cap() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    IF (SELECT count(*) FROM outbox.queue_level l WHERE l.tenant_id = NEW.tenant_id) > 1000 THEN
        RAISE EXCEPTION 'tenant % would have more than 1000 queues (kinds × priorities)',
            NEW.tenant_id
            USING ERRCODE = 'OBX01';
    END IF;
    RETURN NULL;
END
$$;
