"""PostgreSQL access: the pool, migrations and repositories. The only package that imports asyncpg."""
