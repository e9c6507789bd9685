"""Write ``constraints.txt``: the exact versions of hybridnorm's [dev] dependency tree as installed now.

``make test`` installs with ``-c constraints.txt``, so a fresh machine gets the environment the suite last
passed on, not whatever the package index serves that day. Update it deliberately, in its own commit::

    pip install -e '.[dev]' --upgrade          # (or pin one package up by hand)
    python tools/pin_constraints.py            # rewrites constraints.txt from what is installed
    make test                                   # then commit constraints.txt and the README's date line

torch is left out: the Makefile pins it itself (``TORCH=torch==2.13.0``, a CPU wheel on our machines) so
that a CPU machine never downloads CUDA wheels.
"""

from __future__ import annotations

import datetime
import re
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = {"torch", "hybridnorm"}  # torch: pinned by the Makefile; hybridnorm: this checkout


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(dist: metadata.Distribution, extras: set[str]) -> list[str]:
    """Names of the distributions ``dist`` needs (with the given extras), markers evaluated here."""
    from packaging.requirements import Requirement

    names = []
    for line in dist.requires or []:
        req = Requirement(line)
        envs = [{"extra": e} for e in extras] or [{"extra": ""}]
        if req.marker is None or any(req.marker.evaluate(env) for env in envs):
            names.append(canonical(req.name))
    return names


def closure() -> dict[str, str]:
    """Every installed distribution reachable from hybridnorm[dev], name -> version."""
    seen: dict[str, str] = {}
    todo = requirements(metadata.distribution("hybridnorm"), {"dev"})
    while todo:
        name = todo.pop()
        if name in seen or name in SKIP:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:  # an optional requirement not installed here
            continue
        seen[name] = dist.version
        todo.extend(requirements(dist, set()))
    return dict(sorted(seen.items()))


def main() -> int:
    pins = closure()
    py = ".".join(map(str, sys.version_info[:2]))
    lines = [f"# hybridnorm's test environment, pinned {datetime.date.today()} on Python {py} by",
             "# tools/pin_constraints.py (see its docstring to update). torch is pinned by the Makefile.",
             *(f"{name}=={version}" for name, version in pins.items())]
    (ROOT / "constraints.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"constraints.txt: {len(pins)} packages")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
