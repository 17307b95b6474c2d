"""`python -m services.gateway`: run the gateway until SIGTERM/SIGINT."""

from services.common.server import serve
from services.gateway.config import GatewaySettings
from services.gateway.server import create_server


def main() -> None:
    serve("gateway", create_server, GatewaySettings())


if __name__ == "__main__":
    main()
