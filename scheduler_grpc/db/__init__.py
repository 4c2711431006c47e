"""PostgreSQL access: the pool, migrations, repositories (all the SQL) and what its errors mean
(`faults`). The only package that imports asyncpg (tests/test_layout.py checks)."""
