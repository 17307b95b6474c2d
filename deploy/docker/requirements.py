"""Prints the project's pinned runtime dependencies from pyproject.toml, one per line: the
client's, those of the --extra groups (the images take `server`), less the ones named with
--exclude (by distribution name). The images install from this so the pins live in one place;
the control-plane image excludes torch and the model stack.

    python requirements.py /app/pyproject.toml --extra server --exclude torch transformers peft
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib


def dist_name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if not match:
        raise ValueError(f"unparsable requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def requirements(pyproject: str, exclude: list[str], extras: list[str]) -> list[str]:
    with open(pyproject, "rb") as fh:
        project = tomllib.load(fh)["project"]
    wanted = list(project["dependencies"])
    for extra in extras:
        wanted += project.get("optional-dependencies", {})[extra]
    skip = {dist_name(name) for name in exclude}
    return [req for req in wanted if dist_name(req) not in skip]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("pyproject")
    parser.add_argument("--exclude", nargs="*", default=[], help="distribution names to leave out")
    parser.add_argument("--extra", nargs="*", default=[], help="optional-dependency groups to add")
    args = parser.parse_args(argv)
    sys.stdout.write("".join(f"{req}\n" for req in requirements(args.pyproject, args.exclude, args.extra)))


if __name__ == "__main__":
    main()
