"""Generated gRPC stubs of protos/ (scripts/gen_protos.py; do not edit): v1 is the public API
(package valora.v1), internal/v1 the services' API to each other (valora.internal.v1)."""
