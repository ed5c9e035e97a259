CREATE OR REPLACE FUNCTION outbox.commit_time(xid xid8) RETURNS timestamptz
LANGUAGE sql STABLE
RETURN pg_xact_commit_timestamp((xid::text::numeric % 4294967296)::text::xid);
