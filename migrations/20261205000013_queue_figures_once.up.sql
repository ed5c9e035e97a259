-- A queue's figures, written once for the claim's allowance (outbox.queue_allowance) and
-- the policies shown to operators (store::policy): its intents in flight, and its bucket's
-- tokens at an instant.

-- Intents of a queue LEASED or SUBMITTED: what its concurrency limit counts. The lease
-- test is always true of a live lease: it lets the lease index serve. PL/pgSQL, planned
-- once per connection (a SQL function with a subquery is not inlined).
CREATE FUNCTION outbox.queue_in_flight(tenant text, queue_kind text) RETURNS bigint
LANGUAGE plpgsql STABLE
AS $$
BEGIN
    RETURN (SELECT count(*) FROM outbox.intent i
            WHERE i.state IN ('leased', 'submitted') AND i.lease_expires_at IS NOT NULL
              AND i.tenant_id = tenant AND i.kind = queue_kind);
END
$$;

-- The tokens of a policy's bucket at `at` (NULL without a rate): refilled at its rate
-- since it was last taken from, up to its burst; never refilled backwards.
CREATE FUNCTION outbox.bucket_tokens(p outbox.queue_policy, at timestamptz) RETURNS float8
LANGUAGE sql IMMUTABLE
RETURN CASE WHEN p.rate_per_second IS NOT NULL THEN
    least(p.burst::float8,
          coalesce(p.tokens, p.burst)
          + p.rate_per_second * greatest(extract(epoch FROM at - coalesce(p.tokens_at, at)), 0))
END;

-- …12's allowance, counting with the functions above.
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

