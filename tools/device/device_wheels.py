"""Fetch into .whl/ the wheels a bare CUDA machine needs to run tools/device/device_check.sh; run it where pip reaches
a package index, in this project's environment (e.g. .venv/bin/python -m tools.device.device_wheels), before the GPU
run.

The CUDA machine the check targets comes with Python 3.12 and a set of
packages (ON_DEVICE: torch with CUDA, triton, transformers, uvloop, httpx,
pytest, ... as its image was read), and reaches no package index; give
--device-freeze FILE, the output of `python3 -m pip freeze` there, to use
what it really holds. What the server and the check's tests need beyond
that is worked out from this environment's installed metadata: the project's requirements (pyproject.toml) and
their requirements, followed until a package the device has, each at the
version installed here. Each is downloaded with --no-deps as a CPython 3.12
manylinux x86-64 wheel (or a pure-Python one). tools/device/device_check.sh
installs whatever .whl/ holds with --no-index --no-deps --target, so one
version of each package must be there: the folder is emptied first. The
checkout itself is not a wheel: the check puts it on PYTHONPATH.

    python -m tools.device.device_wheels            # download into .whl/
    python -m tools.device.device_wheels --list     # print NAME==VERSION, download nothing (no network needed)
    python -m tools.device.device_wheels --device-freeze device-freeze.txt
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from packaging.requirements import Requirement

from tools import REPO_ROOT

# never carried: the device's own CUDA builds (a wheel from here would be the CPU build), whatever its freeze says
DEVICE_BUILDS = frozenset(("torch", "triton"))
CHECK_NEEDS = ("pytest-asyncio", "openai")  # what the check's tests import beyond the package's own requirements
ON_DEVICE = frozenset((
    "torch", "triton", "transformers", "tokenizers", "safetensors", "huggingface-hub", "hf-xet", "numpy", "uvloop",
    "httpx", "httpcore", "h11", "anyio", "idna", "certifi", "pytest", "pluggy", "iniconfig", "hypothesis",
    "sortedcontainers", "jinja2", "markupsafe", "prometheus-client", "packaging", "typing-extensions", "filelock",
    "fsspec", "pyyaml", "regex", "requests", "urllib3", "charset-normalizer", "tqdm", "rich", "pygments",
    "markdown-it-py", "mdurl", "click", "typer", "shellingham", "annotated-doc", "attrs", "psutil", "setuptools",
    "sympy", "mpmath", "networkx", "msgpack",
))
DEVICE_PYTHON = "3.12"
# newest first; llguidance's wheel is manylinux_2_31, which a list ending at 2_28 misses
PLATFORMS = ("manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
MARKER_ENVIRONMENT = {"python_version": DEVICE_PYTHON, "python_full_version": f"{DEVICE_PYTHON}.0",
                      "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
                      "os_name": "posix", "implementation_name": "cpython", "extra": ""}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def project_requirements() -> list[str]:
    """The names the installed pagedserve requires without extras (pyproject.toml's [project] dependencies): what the
    server imports wherever it runs."""
    requirements = (Requirement(line) for line in distribution("pagedserve").requires or ())
    return [r.name for r in requirements if r.marker is None or r.marker.evaluate(MARKER_ENVIRONMENT)]


def wheels_needed(on_device: frozenset[str]) -> dict[str, str]:
    """{normalized name: version installed here} of the project's requirements and CHECK_NEEDS, and what they
    require on the device's Python, followed until a package the device has."""
    found: dict[str, str] = {}
    pending = [*project_requirements(), *CHECK_NEEDS]
    while pending:
        name = normalize(pending.pop())
        if name in found or name in on_device or name in DEVICE_BUILDS:
            continue
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            raise SystemExit(f"{name} is not installed here; install the project's environment first") from None
        found[name] = dist.version
        for line in dist.requires or ():
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate(MARKER_ENVIRONMENT):
                pending.append(requirement.name)
    return dict(sorted(found.items()))


def read_freeze(path: Path) -> frozenset[str]:
    """The names in `pip freeze` output (NAME==VERSION, NAME @ URL, comments)."""
    names = (re.split(r"[=@ ;\[]", line.strip(), maxsplit=1)[0] for line in path.read_text().splitlines())
    return frozenset(normalize(name) for name in names if name and not name.startswith("#"))


def download(pins: dict[str, str], dest: Path) -> None:
    platforms = [flag for platform in PLATFORMS for flag in ("--platform", platform)]
    for name, version in pins.items():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "--python-version", DEVICE_PYTHON, "--implementation", "cp", *platforms,
                        "-d", str(dest), f"{name}=={version}"], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dest", type=Path, default=REPO_ROOT / ".whl")
    parser.add_argument("--list", action="store_true", help="print the pins only")
    parser.add_argument("--device-freeze", type=Path, help="`pip freeze` of the device's Python (default: ON_DEVICE)")
    args = parser.parse_args()
    pins = wheels_needed(read_freeze(args.device_freeze) if args.device_freeze else ON_DEVICE)
    if args.list:
        print("\n".join(f"{name}=={version}" for name, version in pins.items()))
        return
    shutil.rmtree(args.dest, ignore_errors=True)
    args.dest.mkdir(parents=True)
    download(pins, args.dest)
    print(f"{len(pins)} wheels in {args.dest}")


if __name__ == "__main__":
    main()
