-- Restores …12's allowance, which counts on its own, and drops the figures' functions.
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
        -- The lease test is always true of a live lease: it lets the lease index serve.
        SELECT count(*) INTO in_flight FROM outbox.intent i
        WHERE i.state IN ('leased', 'submitted') AND i.lease_expires_at IS NOT NULL
          AND i.tenant_id = tenant AND i.kind = queue_kind;
        allowance := least(allowance, greatest(pol.max_in_flight - in_flight, 0));
    END IF;
    IF pol.rate_per_second IS NOT NULL THEN
        tokens := least(pol.burst::float8,
                        coalesce(pol.tokens, pol.burst)
                        + pol.rate_per_second
                          * greatest(extract(epoch FROM claim_at - coalesce(pol.tokens_at, claim_at)), 0));
        allowance := least(allowance, floor(tokens)::int);
    END IF;
END
$$;


DROP FUNCTION outbox.bucket_tokens(outbox.queue_policy, timestamptz);
DROP FUNCTION outbox.queue_in_flight(text, text);
