-- Limits (issue 22): the limit keys of a run, resolved in the statement that makes the run (the
-- leader's fire, the API's triggers, a flow's downstream run, a dead-letter requeue), from the
-- run's own payload snapshot and its job's limit refs. In SQL so the fire stays one statement and
-- a job without limits costs one comparison (`limits = '[]'`, which the callers test first).
--
-- The rules and the messages repeat scheduler_grpc/limits.py (`resolve_keys`, `KeyTemplate.resolve`;
-- tests/test_limits_wire.py runs both on the same inputs). The payload reaches Python as
-- PostgreSQL prints it, so a number is an integer key exactly when Python reads it as an integer:
-- its text has no fraction or exponent (PostgreSQL never prints an exponent) and it lies in
-- -2^63 .. 2^64 - 1 (orjson, the codec, reads a larger one as a float).
--
-- Returns a JSON array of [limit, key, units] (the job_executions.limit_keys value), or a JSON
-- string: why a ref cannot be resolved (the run is recorded dead with it as its error).
CREATE FUNCTION resolve_limit_keys(refs jsonb, payload jsonb) RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    ref jsonb;
    template text;
    path text[];
    value jsonb;
    kind text;
    key text;
    depth integer;
    prefix text;
    keys jsonb := '[]'::jsonb;
BEGIN
    FOR ref IN SELECT r FROM jsonb_array_elements(refs) AS r LOOP
        template := ref ->> 'key';
        prefix := format('limit %s: key %s: ', quote_literal(ref ->> 'limit'), template);
        IF left(template, 8) <> 'payload.' THEN
            key := template;
        ELSE
            path := string_to_array(substr(template, 9), '.');
            value := payload;
            FOR depth IN 1 .. coalesce(array_length(path, 1), 0) LOOP
                IF jsonb_typeof(value) IS DISTINCT FROM 'object' THEN
                    RETURN to_jsonb(prefix || CASE WHEN depth = 1 THEN 'payload'
                                                   ELSE 'payload.' || array_to_string(path[1:depth - 1], '.') END
                                    || ' is ' || limit_value_kind(value) || ', not an object');
                END IF;
                IF NOT value ? path[depth] THEN
                    RETURN to_jsonb(prefix || 'the payload has no such field');
                END IF;
                value := value -> path[depth];
            END LOOP;
            kind := jsonb_typeof(value);
            IF kind IN ('string', 'boolean') OR limit_value_kind(value) = 'a int' THEN
                key := value #>> '{}';
            ELSE
                RETURN to_jsonb(prefix || 'the value is ' || limit_value_kind(value)
                                || '; a key is a string, integer or boolean');
            END IF;
            IF key = '' THEN
                RETURN to_jsonb(prefix || 'the value is an empty string; a key has at least one character');
            END IF;
            IF char_length(key) > 200 THEN
                RETURN to_jsonb(prefix || 'the value is ' || char_length(key)
                                || ' characters; a key has at most 200');
            END IF;
        END IF;
        keys := keys || jsonb_build_array(jsonb_build_array(ref ->> 'limit', key,
                                                            coalesce((ref ->> 'units')::integer, 1)));
    END LOOP;
    RETURN keys;
END
$$;

-- How limits.py names a JSON value's kind in a message (`_kind_of`, Python's type names).
CREATE FUNCTION limit_value_kind(value jsonb) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE jsonb_typeof(value)
        WHEN 'null' THEN 'null'
        WHEN 'object' THEN 'an object'
        WHEN 'array' THEN 'an array'
        WHEN 'string' THEN 'a str'
        WHEN 'boolean' THEN 'a bool'
        WHEN 'number' THEN CASE WHEN value::text ~ '^-?[0-9]+$'
                                     AND value::text::numeric BETWEEN -9223372036854775808 AND 18446744073709551615
                                THEN 'a int' ELSE 'a number with a fraction' END
    END
$$;
