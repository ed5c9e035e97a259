-- Settles of a region-bound API key keep to its regions. The settle functions (Ack, Fail,
-- ExtendLease, MarkSubmitted) fence by lease only: a key bound to region eu that presents
-- the live lease of an intent of region us (leaked from that region's worker) would have
-- settled it, and an Ack of it ends its side effect for good. A key with regions now asks
-- first which of its items are intents it may settle: of the caller's tenants, in one of
-- its regions or in none, live in outbox.intent (delivered ones moved to the history
-- cannot be settled again; their replays are answered from the lookup that follows the
-- settle, filtered by region as before). The others are sent with a lease no intent
-- carries, so that they cannot apply and are answered NOT_FOUND, as another tenant's are.
-- A region never changes after Enqueue, so the answer cannot go stale before the settle.
--
-- One round trip more, and only for keys with regions; keys without regions call the
-- settle functions as before. A function of its own, rather than a region argument added
-- to the four settle functions, so that servers of the previous release keep calling
-- those unchanged during a rolling upgrade.
CREATE FUNCTION outbox.settleable_in_regions(
    tenants text,
    cross_tenant text,
    intent_ids uuid[],
    regions text[]
) RETURNS SETOF uuid
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
BEGIN
    PERFORM outbox.enter_scope(tenants, cross_tenant);
    RETURN QUERY
        SELECT i.id
        FROM outbox.intent i
        WHERE i.id = ANY (intent_ids)
          AND (i.region = '' OR i.region = ANY (regions));
END
$$;
