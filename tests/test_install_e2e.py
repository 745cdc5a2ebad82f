"""pagedserve as a user installs it: a wheel built from the checkout, installed into a fresh virtual environment
outside it, started from there on a host without a C compiler.

The wheel must carry every kernel source and header, and a build of each
kernel for every CPU tier of its architecture (setup.py compiles them), so
the installed server loads its kernels with $CC pointing at `false` and an
empty cache. The fresh environment gets the wheel alone (--no-deps); its
dependencies (torch and the rest, gigabytes) are read from this test
environment's site-packages through a .pth file, which adds their directory
to sys.path but not the checkout: the test checks that the package is
imported from the wheel's install.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

from gpu_worker.attention import PREFILL_KERNEL_MIN_VECTOR_BITS
from gpu_worker.native.compiled_library import KERNEL_SOURCES
from shared.cpu_tier import current_tier
from shared.default_model import DEFAULT_MODEL_NAME

from helpers.cpu_tiers import KERNEL_TIERS, copy_checkout
from helpers.running_server import start_server, stop_server

BUILD_TIMEOUT_S = 600  # compiles every kernel for every tier: about 30 s on 2 cores


def build_wheel(directory: Path) -> Path:
    """`pip wheel` of a copy of the checkout (setuptools would leave its build directory in the checkout)."""
    checkout = copy_checkout(directory / "checkout")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(directory), str(checkout)], check=True, capture_output=True, timeout=BUILD_TIMEOUT_S)
    (wheel,) = directory.glob("pagedserve-*.whl")
    return wheel


def install_into_fresh_venv(wheel: Path, venv: Path) -> Path:
    """The venv's python, with the wheel installed and this environment's dependencies readable."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
                   check=True, capture_output=True, timeout=300)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (Path(site) / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return python


def test_a_wheel_installed_elsewhere_serves_on_its_kernels_without_a_compiler(tmp_path):
    wheel = build_wheel(tmp_path / "dist")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"gpu_worker/{source}" for source in KERNEL_SOURCES} <= names
    assert {"gpu_worker/attention/vector_math.h", "gpu_worker/attention/paged_rows.h"} <= names
    for source in KERNEL_SOURCES:
        stem = f"gpu_worker/{source}".removesuffix(".c")
        built = {tier.name for tier in KERNEL_TIERS if any(name.startswith(f"{stem}.{tier.name}.") for name in names)}
        assert built == {tier.name for tier in KERNEL_TIERS}, f"{source}: builds for {sorted(built)} only"

    python = install_into_fresh_venv(wheel, tmp_path / "venv")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    imported = subprocess.run([str(python), "-c", "import gpu_worker; print(gpu_worker.__file__)"], cwd=elsewhere,
                              check=True, capture_output=True, text=True).stdout
    assert imported.startswith(str(tmp_path / "venv")), imported

    server = start_server(tmp_path, None, "--standby-workers", "0", launcher=(str(python.with_name("pagedserve")),),
                          cwd=elsewhere, env={"CC": "false", "XDG_CACHE_HOME": str(tmp_path / "cache")},
                          timeout=180)
    try:
        stream = server.client().chat.completions.create(
            model=DEFAULT_MODEL_NAME, messages=[{"role": "user", "content": "Speak."}], max_tokens=10, stream=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        constrained = server.client().chat.completions.create(  # loads the token mask kernel, used on first need
            model=DEFAULT_MODEL_NAME, messages=[{"role": "user", "content": "JSON."}], max_tokens=10,
            response_format={"type": "json_object"},
            extra_body={"top_k": 40})  # top_k keeps the torch filters: their top-p kernel loads too
        log = server.log.read_text()
    finally:
        stop_server(server)
    assert text.strip() and constrained.choices[0].message.content.startswith("{"), log
    tier = current_tier()
    for source in KERNEL_SOURCES:
        used = source != "attention/cpu_prefill.c" or tier.vector_bits >= PREFILL_KERNEL_MIN_VECTOR_BITS
        loaded = f"{Path(source).name}: the {tier.kernel_build} build, installed" in log
        assert loaded == used, f"{source} {'did not load' if used else 'loaded on a tier that runs torch'}:\n{log}"
    assert "unavailable" not in log and "no C compiler" not in log and "Traceback" not in log, log
    assert not (tmp_path / "cache").exists(), "an installed server compiled something"
