DROP FUNCTION outbox.settleable_in_regions(text, text, uuid[], text[]);
