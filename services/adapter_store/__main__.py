"""`python -m services.adapter_store`: settings from VALORA_* (see config.py)."""

from services.adapter_store.config import StoreSettings
from services.adapter_store.server import create_server
from services.common.server import serve


def main() -> None:
    serve("adapter_store", create_server, StoreSettings())


if __name__ == "__main__":
    main()
