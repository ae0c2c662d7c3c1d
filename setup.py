# Static metadata lives in pyproject.toml; this file only declares the extension,
# and ships the llama.cpp engine's library (and its shim's sources) with the package.
import shutil
import sys
from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_py import build_py

# The shim is compiled against llama.cpp's headers (stopline/engine/llama_build.py); an installed
# package carries its sources as stopline/_native/, for a build on the user's machine.
LLAMA_SHIM_SOURCES = ["ext/llama_shim.c", "ext/llama_abi.h"]


class BuildPyWithLlama(build_py):
    """A wheel (not an editable install, which builds on first start) also carries the
    llama.cpp engine's library, built here, so that installing it needs no compiler."""

    def run(self):
        super().run()
        target = Path(self.build_lib) / "stopline" / "_native"
        target.mkdir(parents=True, exist_ok=True)
        for source in LLAMA_SHIM_SOURCES:
            shutil.copy(source, target / Path(source).name)
        if not getattr(self, "editable_mode", False):
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from stopline.engine.llama_build import PACKAGED_LIBRARY, ensure_llama_library

            # Copied whatever the times say: the cached library of other shim sources may be older
            # than the one a previous build left here (copy_file keeps a newer target).
            shutil.copy(ensure_llama_library(), target / PACKAGED_LIBRARY)


setup(
    cmdclass={"build_py": BuildPyWithLlama},
    ext_modules=cythonize(
        # ext/stopline/ holds the Cython sources as a cimport package (qualified
        # cimports of its .pxd files); ext/ the C headers.
        [
            Extension(
                "stopline._core",
                ["ext/stopline/_core.pyx"],
                include_dirs=["ext"],
                depends=[
                    "ext/ctransformers_abi.h",
                    "ext/llama_abi.h",
                    "ext/step_abort.h",
                    "ext/loop_support.h",
                    "ext/stopline/_batcher.pxi",
                    "ext/stopline/_core.pxd",
                    "ext/stopline/_ctransformers.pxd",
                    "ext/stopline/_llama.pxd",
                    "ext/stopline/_loop_support.pxd",
                ],
                libraries=["dl"],
                extra_compile_args=["-O2"],
            )
        ],
        include_path=["ext"],
        compiler_directives={"language_level": "3"},
    ),
)
