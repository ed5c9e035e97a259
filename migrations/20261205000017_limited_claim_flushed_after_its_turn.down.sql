-- Restores …13's allowance.
CREATE OR REPLACE FUNCTION outbox.queue_allowance(
    tenant text, queue_kind text, claim_at timestamptz, wanted int,
    OUT allowance int, OUT tokens float8
)
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    pol outbox.queue_policy;
    in_flight bigint;
BEGIN
    allowance := wanted;
    IF current_setting('outbox.holds_a_policy', true) = 'on' THEN
        SELECT * INTO pol FROM outbox.queue_policy p
        WHERE p.tenant_id = tenant AND p.kind = queue_kind
        FOR UPDATE SKIP LOCKED;
    ELSE
        SELECT * INTO pol FROM outbox.queue_policy p
        WHERE p.tenant_id = tenant AND p.kind = queue_kind
        FOR UPDATE;
        IF FOUND THEN
            PERFORM set_config('outbox.holds_a_policy', 'on', true);
        END IF;
    END IF;
    IF NOT FOUND OR pol.paused THEN
        allowance := 0;
        RETURN;
    END IF;
    IF pol.max_in_flight IS NOT NULL THEN
        in_flight := outbox.queue_in_flight(tenant, queue_kind);
        allowance := least(allowance, greatest(pol.max_in_flight - in_flight, 0));
    END IF;
    IF pol.rate_per_second IS NOT NULL THEN
        tokens := outbox.bucket_tokens(pol, claim_at);
        allowance := least(allowance, floor(tokens)::int);
    END IF;
END
$$;
