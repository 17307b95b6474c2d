"""Container health check: asks the service's own gRPC health endpoint (grpc.health.v1)
and exits 0 only when it answers SERVING. Uses grpcio-health-checking, already in the
image, so nothing is downloaded at run time.

    python /usr/local/bin/valora-healthcheck [SERVICE_NAME]

Address: 127.0.0.1:$VALORA_PORT (override with VALORA_HEALTH_ADDRESS). The empty service
name asks about the server as a whole, which `services.common.server` keeps in step with
the service (NOT_SERVING while draining).
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    address = os.environ.get("VALORA_HEALTH_ADDRESS") or f"127.0.0.1:{os.environ.get('VALORA_PORT', '50051')}"
    service = argv[1] if len(argv) > 1 else ""
    timeout = float(os.environ.get("VALORA_HEALTH_TIMEOUT_S", "3"))
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
    except grpc.RpcError as err:
        print(f"{address}: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"{address}: {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
