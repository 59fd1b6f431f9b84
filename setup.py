"""Build of the native code: the server's data plane (``pleserver._native``)
and the channel's synchronization words, which the client needs too
(``pleclient._sync``). Everything else about the package is in pyproject.toml.

Both are built on the stable ABI (``Py_LIMITED_API`` of Python 3.11, abi3):
one wheel per platform serves every CPython from 3.11 on.

Environment:
  PLESERVER_WERROR=1        compiler warnings are errors. The Makefile's targets,
                            and so CI, set it; a user's install from source does
                            not, so a newer compiler's new warning cannot fail it.
  PLESERVER_LIMITED_API=0   build for this interpreter's full C API instead
                            (bench/micro/abi3_overhead.py compares the two).

The package also carries the files an operator installs, copied from deploy/
at build time (``BuildPy``): the systemd units, the sysusers.d and tmpfiles.d
snippets, the default config and the configs of particular boxes
(deploy/boxes/), so that a wheel installs the service without the source
tree (``pleserver files``, ``pleserver config default``). The man
page, man/pleserver.1 (committed, made by ``make man``), installs as
``share/man/man1/pleserver.1`` under the environment's prefix, where ``man``
finds it beside the environment's ``bin/`` on the PATH.
"""

import os
from glob import glob

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

# deploy/'s files the package carries, as pleserver/deploy/<same path>
# (pleserver/ops/deployfiles.py says where each one installs). MANIFEST.in puts
# them in the sdist, which wheels may be built from.
DEPLOY_DATA = [
    "deploy/config.toml",
    *sorted(glob("deploy/boxes/*")),
    *sorted(glob("deploy/systemd/*")),
]

WERROR = os.environ.get("PLESERVER_WERROR", "0") == "1"
LIMITED_API = os.environ.get("PLESERVER_LIMITED_API", "1") != "0"
# 3.11: the first whose limited API has the buffer protocol (both modules take
# buffers: ids, rows, the mapped channel).
LIMITED_API_HEX = "0x030B0000"
LIMITED_API_TAG = "cp311"

COMPILE_ARGS = [
    "-std=c11",
    "-O2",
    "-Wall",
    "-Wextra",
    *(["-Werror"] if WERROR else []),
    "-D_GNU_SOURCE",
    "-fvisibility=hidden",
]


class BuildExt(build_ext):
    """An in-place build also removes the module built under the other ABI's
    file name: Python looks for ``_native.cpython-311-….so`` before
    ``_native.abi3.so``, so an older full-API build left beside a new abi3 one
    would be the one imported."""

    def run(self) -> None:
        super().run()
        if not self.inplace:
            return
        for ext in self.extensions:
            built = os.path.abspath(self.get_ext_fullpath(ext.name))
            folder, stem = os.path.dirname(built), ext.name.rsplit(".", 1)[-1]
            for other in glob(os.path.join(folder, f"{stem}.*.so")):
                if os.path.abspath(other) != built:
                    os.remove(other)


class BuildPy(build_py):
    """Copies ``DEPLOY_DATA`` into the built package. An editable install
    builds nothing: ``pleserver.ops.deployfiles`` reads the checkout's deploy/."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for source, target in self._deploy_data():
            self.mkpath(os.path.dirname(target))
            self.copy_file(source, target, preserve_mode=False)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        if getattr(self, "editable_mode", False):
            return outputs
        return outputs + [target for _, target in self._deploy_data()]

    def _deploy_data(self) -> list[tuple[str, str]]:
        return [(path, os.path.join(self.build_lib, "pleserver", path)) for path in DEPLOY_DATA]


def native(name: str, folder: str) -> Extension:
    return Extension(
        name,
        sources=sorted(glob(f"{folder}/*.c")),
        depends=sorted(glob(f"{folder}/*.h")),
        extra_compile_args=COMPILE_ARGS,
        extra_link_args=["-pthread"],
        define_macros=[("Py_LIMITED_API", LIMITED_API_HEX)] if LIMITED_API else [],
        py_limited_api=LIMITED_API,
    )


setup(
    ext_modules=[
        native("pleserver._native", "pleserver/native"),
        native("pleclient._sync", "pleclient/native"),
    ],
    cmdclass={"build_ext": BuildExt, "build_py": BuildPy},
    # (MANIFEST.in puts the page in the sdist, which wheels may be built from.)
    data_files=[("share/man/man1", ["man/pleserver.1"])],
    options={"bdist_wheel": {"py_limited_api": LIMITED_API_TAG}} if LIMITED_API else {},
)
