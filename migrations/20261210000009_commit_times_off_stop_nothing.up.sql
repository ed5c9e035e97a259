-- With track_commit_timestamp off (a standby promoted without it, a restart that turned it
-- off), pg_xact_commit_timestamp raises instead of answering: the promotion of every
-- tenant's staged intents failed with it whenever one was ordered, and so did the Ack of
-- an ordered key's head. A commit time is then unknown (NULL), as for a transaction too
-- old to tell: the intents are promoted, an ordered one ahead of its key's intents whose
-- commit time is known (as one too old to tell is), those unknown in the order they were
-- staged; new ordered intents are still refused (outbox.lock_ordering_keys).

CREATE OR REPLACE FUNCTION outbox.commit_time(xid xid8) RETURNS timestamptz
LANGUAGE sql STABLE
RETURN CASE WHEN current_setting('track_commit_timestamp')::boolean
            THEN pg_xact_commit_timestamp((xid::text::numeric % 4294967296)::text::xid)
       END;
