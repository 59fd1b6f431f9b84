"""Build of the native code: the server's data plane (``pleserver._native``)
and the channel's synchronization words, which the client needs too
(``pleclient._sync``). Everything else about the package is in pyproject.toml."""

from glob import glob

from setuptools import Extension, setup

COMPILE_ARGS = [
    "-std=c11",
    "-O2",
    "-Wall",
    "-Wextra",
    "-Werror",
    "-D_GNU_SOURCE",
    "-fvisibility=hidden",
]


def native(name: str, folder: str) -> Extension:
    return Extension(
        name,
        sources=sorted(glob(f"{folder}/*.c")),
        depends=sorted(glob(f"{folder}/*.h")),
        extra_compile_args=COMPILE_ARGS,
        extra_link_args=["-pthread"],
    )


setup(
    ext_modules=[
        native("pleserver._native", "pleserver/native"),
        native("pleclient._sync", "pleclient/native"),
    ],
)
