# Static metadata lives in pyproject.toml; this file only declares the extension.
from Cython.Build import cythonize
from setuptools import Extension, setup

setup(
    ext_modules=cythonize(
        [Extension("stopline._core", ["ext/_core.pyx"], include_dirs=["ext"],
                   depends=["ext/ctransformers_abi.h", "ext/step_abort.h", "ext/loop_support.h"],
                   libraries=["dl"], extra_compile_args=["-O2"])],
        include_path=["ext"],
        compiler_directives={"language_level": "3"},
    ),
)
