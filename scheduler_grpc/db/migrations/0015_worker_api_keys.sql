-- Issue 23: API keys of the `worker` role, which may call WorkerService.Connect and nothing else
-- (auth.Role.WORKER). Users never have it: the users table's CHECK is unchanged.
ALTER TABLE api_keys DROP CONSTRAINT api_keys_role_check;
ALTER TABLE api_keys ADD CONSTRAINT api_keys_role_check CHECK (role IN ('viewer', 'operator', 'admin', 'worker'));
