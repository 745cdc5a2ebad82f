"""Builds the worker's C kernels into the package at install, for every CPU tier of this architecture.

Everything else is in pyproject.toml. `pip install .`, `pip wheel .` and
`pip install -e .` all run build_py, which here also compiles each kernel
source once per tier build (gpu_worker/native/compiled_library.py says which and
why); the worker then loads the build for the CPU it runs on and needs no
compiler. Without a compiler the install still succeeds, with a warning:
the worker then serves on torch's ops.
"""

import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

sys.path.insert(0, str(Path(__file__).parent))  # the package's own build helper, importable without torch

from gpu_worker.native.compiled_library import LibraryBuildError, default_compiler, install_all  # noqa: E402


class BuildPyWithKernels(build_py):
    def run(self) -> None:
        super().run()
        package_dir = None if self.editable_mode else Path(self.build_lib) / "gpu_worker"
        try:
            built = install_all(default_compiler(), package_dir)
        except LibraryBuildError as error:
            self.warn(f"the CPU kernels were not built, so the worker will serve on torch's ops (slower): {error}")
            return
        self.announce(f"built {len(built)} CPU kernel libraries", level=2)


class BinaryDistribution(Distribution):
    """A wheel with compiled kernels is specific to its platform."""

    def has_ext_modules(self) -> bool:
        return True


setup(cmdclass={"build_py": BuildPyWithKernels}, distclass=BinaryDistribution)
