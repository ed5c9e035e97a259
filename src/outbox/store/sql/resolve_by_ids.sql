-- An operator's decision on these intents (store::resolve_intents), each recorded in
-- outbox.resolution in the same statement. $1 the states the decision applies to,
-- $2 the decision ('delivered', 'requeue', 'dead' or 'cancel'), $3 actor, $4 reason, $5
-- now (or NULL), $6 the pending channel (a requeue wakes claimers), $7 the API key's regions
-- (empty: any), $8 the intent ids, $9 each one's updated_at as the caller saw it (or
-- empty: any), $10 the caller's API key (its name). One row per id, in request order:
-- whether it applied, the state it left the intent in, and its tenant and ordering key (to
-- advance).
WITH input AS (
    SELECT * FROM unnest($8::uuid[], $9::timestamptz[]) WITH ORDINALITY AS t(id, seen, ord)
),
target AS (
    SELECT i.id, i.state
    FROM outbox.intent i
    JOIN input ON input.id = i.id
    WHERE (i.state = ANY($1)
           -- DEAD on a DEAD_LETTERED intent that holds its ordering key releases the key.
           OR ($2 = 'dead' AND i.state = 'dead_lettered' AND i.ordering_key IS NOT NULL
               AND i.finished_at IS NULL))
      -- An ordered dead letter given up (DEAD) let its key move on: that decision is final.
      AND NOT (i.state = 'dead_lettered' AND i.ordering_key IS NOT NULL
               AND i.finished_at IS NOT NULL)
      AND (cardinality($7::text[]) = 0 OR i.region = '' OR i.region = ANY($7::text[]))
      AND (input.seen IS NULL OR i.updated_at = input.seen)
    FOR UPDATE OF i
),
resolved AS (
    UPDATE outbox.intent i
    SET state = CASE $2
            WHEN 'delivered' THEN 'delivered'
            -- An ordered one waits for its key (outbox.advance_keys, run next).
            WHEN 'requeue' THEN CASE WHEN i.ordering_key IS NULL THEN 'pending' ELSE 'waiting' END
            WHEN 'cancel' THEN 'cancelled'
            ELSE 'dead_lettered'
        END::outbox.intent_state,
        attempts = CASE WHEN $2 = 'requeue' THEN 0 ELSE i.attempts END,
        available_at = CASE WHEN $2 = 'requeue' THEN coalesce($5::timestamptz, now())
                            ELSE i.available_at END,
        -- A DEAD_LETTERED ordered intent with a finish time no longer holds its key.
        finished_at = CASE WHEN $2 IN ('delivered', 'cancel')
                                OR ($2 = 'dead' AND i.ordering_key IS NOT NULL)
                           THEN coalesce($5::timestamptz, now()) END,
        lease_id = NULL,
        lease_expires_at = NULL,
        updated_at = coalesce($5::timestamptz, now())
    FROM target
    WHERE i.id = target.id
    RETURNING i.id, i.tenant_id, i.state, target.state AS from_state, i.ordering_key
),
recorded AS (
    INSERT INTO outbox.resolution (tenant_id, intent_id, from_state, decision, actor, reason,
                                   resolved_at, api_key)
    SELECT tenant_id, id, from_state, $2, $3, $4, coalesce($5::timestamptz, now()), $10
    FROM resolved
    RETURNING intent_id
),
woken AS (
    SELECT pg_notify($6, '') WHERE $2 = 'requeue' AND EXISTS (SELECT 1 FROM resolved)
)
SELECT input.id, resolved.id IS NOT NULL AS applied, resolved.state, resolved.tenant_id,
       resolved.ordering_key
FROM input
LEFT JOIN resolved ON resolved.id = input.id
CROSS JOIN (SELECT count(*) FROM recorded) AS r
CROSS JOIN (SELECT count(*) FROM woken) AS w
ORDER BY input.ord
