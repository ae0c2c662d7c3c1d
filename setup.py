# Static metadata lives in pyproject.toml; this file only declares the extension,
# and ships the llama.cpp shim's sources with the package.
from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_py import build_py

# Compiled on the user's machine against llama.cpp's headers (stopline/llama_build.py),
# so an installed package carries them as stopline/_native/.
LLAMA_SHIM_SOURCES = ["ext/llama_shim.c", "ext/llama_abi.h"]


class BuildPyWithShim(build_py):
    def run(self):
        super().run()
        target = Path(self.build_lib) / "stopline" / "_native"
        target.mkdir(parents=True, exist_ok=True)
        for source in LLAMA_SHIM_SOURCES:
            self.copy_file(source, str(target / Path(source).name))


setup(
    cmdclass={"build_py": BuildPyWithShim},
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
