"""The adapter store: registry of adapters, immutable content-addressed versions, aliases and
tasks (metadata in SQL through SQLAlchemy + Alembic, bundles in a blob store). Serves the
registry RPCs of valora.v1.AdminService and valora.internal.v1.AdapterStoreService."""
