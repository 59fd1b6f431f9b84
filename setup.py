"""Build of the native data plane (``pleserver._native``); everything else
about the package is in pyproject.toml."""

from glob import glob

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "pleserver._native",
            sources=sorted(glob("pleserver/native/*.c")),
            depends=sorted(glob("pleserver/native/*.h")),
            extra_compile_args=["-std=c11", "-O2", "-Wall", "-Wextra", "-Werror",
                                "-D_GNU_SOURCE", "-fvisibility=hidden"],
            extra_link_args=["-pthread"],
        )
    ],
)
