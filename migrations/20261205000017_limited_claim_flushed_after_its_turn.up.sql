-- The claims of one limited queue take turns on its policy row, held to each claim's
-- commit, and a commit waited for its WAL flush (and a synchronous standby) inside the
-- turn. A claim that takes a policy row now commits without waiting; the server forces
-- the flush (a later commit that waits) before it answers, so nothing is answered before
-- it is durable, and the flushes of queued claims are shared.
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
            -- Claims of this queue wait for this row until this transaction ends: it ends
            -- without waiting for its WAL to be flushed, and the server flushes it before
            -- it answers (store::claim_intents), outside the queue's turn.
            PERFORM set_config('synchronous_commit', 'off', true);
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
