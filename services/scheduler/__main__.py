"""`python -m services.scheduler`: run the scheduler until SIGTERM/SIGINT."""

from services.common.server import serve
from services.scheduler.config import SchedulerSettings
from services.scheduler.server import create_server


def main() -> None:
    serve("scheduler", create_server, SchedulerSettings())


if __name__ == "__main__":
    main()
