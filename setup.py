"""Declares the optional C extension; all other metadata is in pyproject.toml.

The extension (the native atomic backend) is built when a C compiler is
present.  Without one the build still succeeds and shmlimit uses the
portable ``atomics`` backend.  Wheel builds set ``SHMLIMIT_REQUIRE_NATIVE_BUILD=1``
(see ``[tool.cibuildwheel]``): a wheel without the extension must fail to
build, never ship.
"""

import os

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "shmlimit.shm._native",
            ["shmlimit/shm/_native.c"],
            optional=os.environ.get("SHMLIMIT_REQUIRE_NATIVE_BUILD") != "1",
            extra_compile_args=["-O2", "-std=gnu11"],
        )
    ]
)
