"""Prints the project's pinned runtime dependencies from pyproject.toml, one per line: the
client's, those of the --extra groups (an extra naming the project itself, `valora[server]`, is
expanded), less the ones named with --exclude (by distribution name). The control-plane image
installs `--extra server` from this, under deploy/requirements.lock's versions.

    python requirements.py /app/pyproject.toml --extra server
    python requirements.py pyproject.toml --extra generator cuda --exclude torch
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


def extra_requirements(project: dict, extra: str, seen: set[str] | None = None) -> list[str]:
    """The requirements of one extra, its references to the project's own extras expanded."""
    seen = set() if seen is None else seen
    if extra in seen:
        return []
    seen.add(extra)
    out = []
    for req in project.get("optional-dependencies", {})[extra]:
        if dist_name(req) == dist_name(project["name"]):
            for inner in re.search(r"\[([^\]]*)\]", req).group(1).split(","):
                out += extra_requirements(project, inner.strip(), seen)
        else:
            out.append(req)
    return out


def requirements(pyproject: str, exclude: list[str], extras: list[str]) -> list[str]:
    with open(pyproject, "rb") as fh:
        project = tomllib.load(fh)["project"]
    wanted = list(project["dependencies"])
    seen: set[str] = set()
    for extra in extras:
        wanted += extra_requirements(project, extra, seen)
    skip = {dist_name(name) for name in exclude}
    out = []
    for req in wanted:
        if dist_name(req) not in skip and req not in out:
            out.append(req)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("pyproject")
    parser.add_argument("--exclude", nargs="*", default=[], help="distribution names to leave out")
    parser.add_argument("--extra", nargs="*", default=[], help="optional-dependency groups to add")
    args = parser.parse_args(argv)
    sys.stdout.write("".join(f"{req}\n" for req in requirements(args.pyproject, args.exclude, args.extra)))


if __name__ == "__main__":
    main()
