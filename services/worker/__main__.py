"""`python -m services.worker`: one worker (one GPU, or the CPU) serving WorkerService."""

from services.common.server import serve
from services.worker.config import WorkerSettings
from services.worker.server import create_server


def main() -> None:
    serve("worker", create_server, WorkerSettings())


if __name__ == "__main__":
    main()
