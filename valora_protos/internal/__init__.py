"""The services' internal APIs (protos/valora/internal)."""
