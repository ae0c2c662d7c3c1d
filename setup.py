# Static metadata lives in pyproject.toml; this file only declares the extension.
from Cython.Build import cythonize
from setuptools import Extension, setup

setup(
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
                    "ext/step_abort.h",
                    "ext/loop_support.h",
                    "ext/stopline/_core.pxd",
                    "ext/stopline/_ctransformers.pxd",
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
