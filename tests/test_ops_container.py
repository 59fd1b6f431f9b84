"""deploy/container/'s images, checked without a container engine (CI has none,
nor a registry to pull the base images from).

Each Dockerfile is parsed; its build context is made as ``docker build`` makes
it, the source tree through .dockerignore (build outputs of this checkout
included, as a user's checkout holds them), and its COPY lines are resolved
against it: every file the package's sdist is made of must reach the folder the
image installs from. Marker ``images`` (``make images``, in CI): each image is
then built as far as its Python goes. The files its COPY lines carry are copied
into a folder standing in for the image's file system, a fresh venv stands in
for the base image's Python, its RUN steps that run pip or Python are run there
(absolute paths moved under that folder), and the result is checked as the
image would run it: the native modules import from the installed files, the
ENTRYPOINT (or ``pleserver`` on PATH) prints the version, the vLLM plugin's
entry point, the license and the deploy files are installed.
tests/test_aarch64.py runs the same build on arm64, in a Debian under qemu.

What cannot be checked here: whether each base image is published for each
architecture and holds a compiler and Python's headers, and the RUN steps
that install system packages (apt-get): the host's own packages stand in.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, requires, version
from pathlib import Path
from typing import NoReturn

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from pleserver.ops import deployfiles
from tests.test_ops_install import WHEEL_CHECK, check_installed

REPO = Path(__file__).resolve().parent.parent
CONTAINER = REPO / "deploy" / "container"
DOCKERFILES = ("Dockerfile", "ple-server.Dockerfile")
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
# The image's PATH in the stand-in: the base venv's bin, then the system's (its
# compiler); not this test's own venv.
IMAGE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Instructions the check understands; one it does not (ADD, SHELL, ONBUILD, …)
# fails it, rather than being passed over.
UNDERSTOOD = {
    "FROM",
    "ARG",
    "COPY",
    "RUN",
    "WORKDIR",
    "ENV",
    "USER",
    "ENTRYPOINT",
    "CMD",
    "LABEL",
    "EXPOSE",
    "STOPSIGNAL",
}
# Of the package's dependencies, those a base image's Python holds already: the
# stand-in for it gets them first. vLLM's image holds what vLLM requires
# (test_the_vllm_image_holds_what_the_check_says checks the list).
BASE_PACKAGES = {"vllm/vllm-openai": ("numpy", "prometheus_client")}
SYSTEM_PACKAGES = re.compile(r"\b(apt-get|apt|apk|dnf|yum|microdnf)\b")
REPORT = "IMAGE-REPORT "


def fail(message: str) -> NoReturn:
    pytest.fail(message, pytrace=False)


# ------------------------------------------------------------ Dockerfiles
@dataclass(frozen=True)
class Instruction:
    where: str  # Dockerfile:line
    keyword: str
    flags: dict[str, str]
    text: str  # what follows the flags, continuation lines joined

    def words(self) -> list[str]:
        """The arguments: the JSON (exec) form's list, else split as a shell would."""
        if self.text.startswith("["):
            return list(json.loads(self.text))
        return shlex.split(self.text)


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


@dataclass
class Dockerfile:
    path: Path
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(name)


def logical_lines(text: str, where: str) -> list[tuple[int, str]]:
    """Instructions with their continuation lines (a trailing backslash) joined,
    comment lines dropped, as Docker's parser reads them."""
    if re.match(r"#\s*escape\s*=", text):
        fail(f"{where}: the escape directive is not understood by this check")
    out: list[tuple[int, str]] = []
    parts: list[str] = []
    start = 0
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("#") or not stripped:
            continue
        if not parts:
            start = number
        if stripped.endswith("\\"):
            parts.append(line.rstrip()[:-1])
            continue
        parts.append(line)
        out.append((start, "".join(parts).strip()))
        parts = []
    if parts:
        fail(f"{where}:{start}: the last instruction ends in a continuation")
    return out


def substitute(text: str, args: dict[str, str], where: str) -> str:
    """``$NAME`` and ``${NAME}`` from the ARGs declared before the first FROM."""

    def value(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in args:
            fail(f"{where}: ${name} has no default (ARG {name}=… before FROM)")
        return args[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, text)


def parse(path: Path) -> Dockerfile:
    stages: list[Stage] = []
    global_args: dict[str, str] = {}
    for line, text in logical_lines(path.read_text(), path.name):
        where = f"{path.name}:{line}"
        keyword, _, rest = text.partition(" ")
        keyword = keyword.upper()
        if keyword not in UNDERSTOOD:
            fail(
                f"{where}: {keyword} is not understood by this check (tests/test_ops_container.py)"
            )
        rest = rest.strip()
        if "<<" in rest and keyword in ("RUN", "COPY"):
            fail(f"{where}: heredocs are not understood by this check")
        flags: dict[str, str] = {}
        while rest.startswith("--"):
            flag, _, rest = rest.partition(" ")
            name, _, value = flag[2:].partition("=")
            flags[name] = value
            rest = rest.strip()
        if keyword == "ARG" and not stages:
            name, _, default = rest.partition("=")
            global_args[name] = default.strip('"')
            continue
        if keyword == "FROM":
            words = substitute(rest, global_args, where).split()
            if len(words) not in (1, 3) or (len(words) == 3 and words[1].upper() != "AS"):
                fail(f"{where}: FROM {rest!r} is not `FROM IMAGE [AS NAME]`")
            stages.append(Stage(words[0], words[2] if len(words) == 3 else None))
            continue
        if not stages:
            fail(f"{where}: {keyword} before the first FROM")
        if keyword == "COPY":
            unknown = set(flags) - {"from", "chown", "chmod", "link"}
            if unknown or "$" in rest:
                fail(f"{where}: COPY {sorted(unknown) or rest} is not understood by this check")
        stages[-1].instructions.append(Instruction(where, keyword, flags, rest))
    if not stages:
        fail(f"{path.name}: no FROM")
    return Dockerfile(path, stages)


def dockerfile(name: str) -> Dockerfile:
    return parse(CONTAINER / name)


# ------------------------------------------------------------ the build context
@dataclass(frozen=True)
class Pattern:
    text: str
    regex: re.Pattern[str]
    exception: bool  # a `!` line: lets back through what an earlier line excluded


def glob_regex(pattern: str, double_star: bool) -> str:
    """Go's filepath.Match syntax (``*``, ``?``, ``[…]``, ``\\`` escapes) as a
    regex; with ``double_star``, .dockerignore's ``**`` (any number of folders)."""
    out, i = "", 0
    while i < len(pattern):
        c = pattern[i]
        if c == "*" and double_star and pattern[i : i + 2] == "**":
            i += 2
            if pattern[i : i + 1] == "/":
                i += 1
                out += "(.*/)?" if i < len(pattern) else ".*"
            else:
                out += ".*"
            continue
        if c == "*":
            out += "[^/]*"
        elif c == "?":
            out += "[^/]"
        elif c == "[":
            end = pattern.find("]", i + 1)
            if end < 0:
                fail(f"unterminated [ in {pattern!r}")
            body = pattern[i + 1 : end]
            out += "[" + ("^" + body[1:] if body.startswith("^") else body) + "]"
            i = end
        elif c == "\\" and i + 1 < len(pattern):
            i += 1
            out += re.escape(pattern[i])
        else:
            out += re.escape(c)
        i += 1
    return out


def ignore_patterns(path: Path) -> list[Pattern]:
    """.dockerignore's lines as Docker reads them: ``#`` comments, ``!``
    exceptions, paths relative to the context (a leading ``/`` dropped)."""
    return parse_ignore(path.read_text().splitlines() if path.exists() else [])


def parse_ignore(lines: Iterable[str]) -> list[Pattern]:
    patterns = []
    for raw in lines:
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        exception = line.startswith("!")
        text = posixpath.normpath(line[1:].strip() if exception else line).lstrip("/")
        regex = re.compile("^" + glob_regex(text, double_star=True) + "$")
        patterns.append(Pattern(text, regex, exception))
    return patterns


def context_ignore(name: str) -> Path:
    """The ignore file a build of ``name`` reads: BuildKit's
    ``<Dockerfile>.dockerignore`` beside it if any, else the context's."""
    own = CONTAINER / f"{name}.dockerignore"
    return own if own.exists() else REPO / ".dockerignore"


def excluded(path: str, patterns: list[Pattern]) -> bool:
    """Docker's rule: the last line matching the path, or a folder above it, decides."""
    parents = path.split("/")
    candidates = ["/".join(parents[: i + 1]) for i in range(len(parents))]
    verdict = False
    for p in patterns:
        if p.exception == verdict and any(p.regex.match(c) for c in candidates):
            verdict = not p.exception
    return verdict


def may_let_back(folder: str, patterns: list[Pattern]) -> bool:
    """Whether an exception could let back something under an excluded folder
    (else the walk skips it, as Docker does)."""
    return any(
        p.exception and (p.text.startswith(folder + "/") or any(c in p.text for c in "*?["))
        for p in patterns
    )


def build_context(files: Iterable[str], patterns: list[Pattern]) -> set[str]:
    """The files of ``files`` that .dockerignore lets into the context."""
    return {path for path in files if not excluded(path, patterns)}


def checkout_context(name: str) -> set[str]:
    """The context ``docker build -f deploy/container/NAME .`` sends from this checkout."""
    walked = []
    patterns = ignore_patterns(context_ignore(name))
    for folder, dirs, files in os.walk(REPO):
        rel = Path(folder).relative_to(REPO).as_posix()
        prefix = "" if rel == "." else rel + "/"
        dirs[:] = [
            d
            for d in dirs
            if not (excluded(prefix + d, patterns) and not may_let_back(prefix + d, patterns))
        ]
        walked += [prefix + f for f in files]
    return build_context(walked, patterns)


def copies(ins: Instruction, context: set[str]) -> list[tuple[str, str]]:
    """A COPY from the context as (file in the context, path in the image)."""
    *sources, dest = ins.words()
    if not sources:
        fail(f"{ins.where}: COPY names no source")
    out = []
    for source in sources:
        src = posixpath.normpath(source).lstrip("/")
        wildcard = any(c in src for c in "*?[")
        if wildcard:
            regex = re.compile("^" + glob_regex(src, double_star=False) + "$")
            folders = {
                "/".join(f.split("/")[:i]) for f in context for i in range(1, f.count("/") + 1)
            }
            matches = sorted(m for m in context | folders if regex.match(m))
        else:
            matches = [src]
        for match in matches:
            under = sorted(
                f for f in context if match == "." or f.startswith(match.rstrip("/") + "/")
            )
            if under:  # a folder: its contents, under dest
                base = "" if match == "." else match + "/"
                out += [(f, posixpath.join(dest, f[len(base) :])) for f in under]
            elif match in context:
                into = dest.endswith("/") or len(sources) > 1 or wildcard
                out.append(
                    (match, posixpath.join(dest, posixpath.basename(match)) if into else dest)
                )
            else:
                why = ".dockerignore excludes it" if (REPO / match).exists() else "no such path"
                fail(f"{ins.where}: COPY {source}: not in the build context ({why})")
    return out


def image_files(df: Dockerfile, context: set[str]) -> dict[str, str]:
    """Every path in the image (any stage) that a COPY from the context makes,
    with the context file it holds."""
    made = {}
    for stage in df.stages:
        for ins in stage.all("COPY"):
            if "from" not in ins.flags:
                made.update({dest: src for src, dest in copies(ins, context)})
    return made


def source_folder(made: dict[str, str]) -> str:
    """The folder in the image that the package is installed from: where
    pyproject.toml is copied."""
    found = [dest for dest, src in made.items() if src == "pyproject.toml"]
    if len(found) != 1:
        fail(f"pyproject.toml is copied to {found or 'nowhere'}: one source folder expected")
    return posixpath.dirname(found[0])


def sdist_inputs() -> set[str]:
    """The files the package is built from, as the sdist holds them: setup.py
    and pyproject.toml, the readme and license files pyproject.toml names,
    MANIFEST.in and what it includes, and the packages' tracked files."""
    wanted = {"setup.py", "pyproject.toml", "MANIFEST.in", PROJECT["readme"]}
    wanted |= {f for pattern in PROJECT["license-files"] for f in glob(pattern)}
    for line in (REPO / "MANIFEST.in").read_text().splitlines():
        words = line.split("#")[0].split()
        if not words:
            continue
        if words[0] != "include":
            fail(f"MANIFEST.in: {words[0]} is not understood by this check (only include)")
        wanted |= {f for pattern in words[1:] for f in glob(pattern)}
    tracked = subprocess.run(
        ["git", "ls-files", "--", "pleserver", "pleclient"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return wanted | {f for f in tracked if (REPO / f).is_file()}


def glob(pattern: str) -> list[str]:
    found = sorted(p.relative_to(REPO).as_posix() for p in REPO.glob(pattern) if p.is_file())
    if not found:
        fail(f"{pattern!r} (MANIFEST.in or pyproject.toml) matches no file")
    return found


# ------------------------------------------------------------ the checks
@pytest.mark.parametrize("name", DOCKERFILES)
def test_each_image_copies_every_file_the_package_is_built_from(name):
    """Without setup.py and MANIFEST.in the client's native module is not
    built; without deploy/'s files the build stops (``can't copy
    'deploy/config.toml'``); without LICENSE the install lacks it."""
    made = image_files(dockerfile(name), checkout_context(name))
    folder = source_folder(made)
    missing = sorted(f for f in sdist_inputs() if posixpath.join(folder, f) not in made)
    assert not missing, (
        f"{name} does not copy to {folder} these files the package is built from: {missing}; "
        f"copy the tree (COPY . {folder}) and let them through .dockerignore"
    )


@pytest.mark.parametrize("name", DOCKERFILES)
def test_each_image_copies_none_of_the_checkouts_build_outputs(name):
    """An in-place build's objects in the image would be stale, or of another
    architecture; .git and venvs would only make the context large."""
    copied = image_files(dockerfile(name), checkout_context(name)).values()
    outputs = sorted(
        f
        for f in copied
        if re.search(r"(^|/)(__pycache__|build|dist|\.git|[^/]*\.egg-info)/|\.(so|o|pyc)$", f)
    )
    assert not outputs, f"{name} copies build outputs of the checkout: {outputs[:20]}"


def test_the_ignore_rules_read_as_docker_reads_them():
    """The .dockerignore reader on Docker's documented cases: the last matching
    line wins, a folder's rule covers what is under it, ``**`` spans folders."""
    patterns = [
        parse_ignore(lines)
        for lines in (
            ["*", "!pkg", "**/*.so", "**/__pycache__"],
            ["docs", "!docs/keep.md", "/build/"],
        )
    ]
    assert not excluded("pkg/mod.py", patterns[0])
    assert excluded("pkg/_native.abi3.so", patterns[0])
    assert excluded("pkg/sub/__pycache__/mod.cpython-311.pyc", patterns[0])
    assert excluded("setup.py", patterns[0]) and excluded(".git/HEAD", patterns[0])
    assert excluded("docs/a.md", patterns[1]) and not excluded("docs/keep.md", patterns[1])
    assert excluded("build/lib/x.so", patterns[1]) and not excluded("src/build.py", patterns[1])
    assert build_context(["pkg/a.py", "pkg/a.so", "README"], patterns[0]) == {"pkg/a.py"}


def test_the_base_images_are_pinned_to_what_the_package_supports():
    """The Python image satisfies requires-python; the vLLM image is the
    release the vllm extra pins (the plugin patches vLLM's classes by path)."""
    bases = {stage.base for name in DOCKERFILES for stage in dockerfile(name).stages}
    bases -= {stage.name for name in DOCKERFILES for stage in dockerfile(name).stages}
    for base in bases:
        image, _, tag = base.rpartition(":")
        assert image and tag and tag != "latest", f"{base}: pin a tag"
        if image == "python":
            python = re.match(r"\d+\.\d+", tag)
            assert python, base
            assert python.group() in SpecifierSet(PROJECT["requires-python"]), base
        elif image == "vllm/vllm-openai":
            (vllm,) = [
                Requirement(r)
                for r in PROJECT["optional-dependencies"]["vllm"]
                if Requirement(r).name == "vllm"
            ]
            assert tag.removeprefix("v") in vllm.specifier, (base, str(vllm))
        else:
            fail(f"{base}: an image this check does not know; say here what it must satisfy")


def test_the_vllm_image_holds_what_the_check_says():
    """BASE_PACKAGES' vLLM entry is what vLLM itself requires of the package's
    dependencies: what its image holds before the Dockerfile's install."""
    try:
        wanted = [Requirement(r) for r in requires("vllm") or []]
    except PackageNotFoundError:
        pytest.skip("vLLM is not installed here (make venv installs it)")
    names = {canonicalize_name(r.name) for r in wanted if r.marker is None or r.marker.evaluate()}
    ours = {canonicalize_name(Requirement(r).name) for r in PROJECT["dependencies"]}
    assert {canonicalize_name(n) for n in BASE_PACKAGES["vllm/vllm-openai"]} == ours & names


def test_the_daemonset_runs_the_servers_image_as_its_user_and_command():
    """The Dockerfile's USER and CMD are the DaemonSet's runAsUser/runAsGroup
    and args (tests/test_ops_kubernetes.py checks the probes against its
    ENTRYPOINT)."""
    final = dockerfile("ple-server.Dockerfile").final
    (user,) = final.all("USER")
    (cmd,) = final.all("CMD")
    (daemonset,) = [
        doc
        for doc in yaml.safe_load_all((REPO / "deploy/kubernetes/ple-server.yaml").read_text())
        if doc and doc["kind"] == "DaemonSet"
    ]
    pod = daemonset["spec"]["template"]["spec"]
    context = pod["securityContext"]
    assert user.text == f"{context['runAsUser']}:{context['runAsGroup']}", user.text
    (server,) = [c for c in pod["containers"] if c["name"] == "ple-server"]
    assert server["args"] == cmd.words(), (server["args"], cmd.words())
    assert "command" not in server  # the image's ENTRYPOINT runs


def test_compose_builds_the_vllm_image_from_the_source_tree():
    compose = yaml.safe_load((CONTAINER / "compose.yaml").read_text())
    build = compose["services"]["vllm"]["build"]
    assert (CONTAINER / build["context"]).resolve() == REPO, build
    assert (REPO / build["dockerfile"]).resolve() == CONTAINER / "Dockerfile", build


# ------------------------------------------------------------ building
# What the image's Python prints after tests/test_ops_install.py's WHEEL_CHECK
# (both native modules, from the installed files): the plugin's entry point,
# the license and the deploy files, as installed.
IMAGE_CHECK = """
import hashlib, json, platform, sys
from importlib import metadata
from pleserver.ops import deployfiles
dist = metadata.distribution("pleserver")
print(REPORT + json.dumps({
    "prefix": sys.prefix,
    "machine": platform.machine(),
    "plugins": sorted(e.name for e in metadata.entry_points(group="vllm.general_plugins")
                      if e.value.startswith("pleclient")),
    "licenses": sorted(str(f) for f in dist.files or () if "/licenses/" in str(f)),
    "deploy_dir": str(deployfiles.directory()),
    "deploy": {f.path: hashlib.sha256(deployfiles.read(f.path).encode()).hexdigest()
               for f in deployfiles.FILES},
}))
""".replace("REPORT", repr(REPORT))
# The environment of a user's build: not this test's venv, nor CI's build
# settings (warnings as errors, …).
CLEAN_ENV = ["env", "-u", "VIRTUAL_ENV", "-u", "PYTHONPATH", "-u", "PYTHONHOME"]
CLEAN_ENV += ["-u", "PLESERVER_WERROR", "-u", "PLESERVER_LIMITED_API"]


def image_roots(df: Dockerfile) -> list[str]:
    """The top folders of the image's own paths (COPY targets, WORKDIRs, the
    ENTRYPOINT, venvs that RUN makes): the stand-in moves them under its folder."""
    stages = df.stages
    paths = [ins.words()[-1] for s in stages for ins in s.all("COPY")]
    paths += [ins.text for s in stages for ins in s.all("WORKDIR")]
    paths += [ins.words()[0] for s in stages for ins in s.all("ENTRYPOINT")]
    paths += [
        v for s in stages for ins in s.all("RUN") for v in re.findall(r"venv\s+(/\S+)", ins.text)
    ]
    roots = sorted({p.split("/")[1] for p in paths if p.startswith("/")})
    assert roots, f"{df.path.name}: no path of the image's own"
    return roots


def build_script(df: Dockerfile, context: set[str], source: str, work: str, python: str) -> str:
    """A bash script that builds ``df`` as far as its Python goes, from the
    context ``context`` (files under the folder ``source``), in the folder
    ``work`` (the image's file system is ``work``/rootfs), with ``python``
    standing in for the base images' interpreter. It prints what
    ``check_report`` reads."""
    rootfs = f"{work}/rootfs"
    moved = re.compile(rf"(?<![\w./$-])/(?=(?:{'|'.join(image_roots(df))})(?:/|\b))")

    def inside(text: str) -> str:
        return moved.sub(rootfs + "/", text)

    lines = ["set -euo pipefail", f"rm -rf {work}", f"mkdir -p {rootfs} {work}/empty"]
    stage_python: list[str] = []  # each stage's base venv
    for number, stage in enumerate(df.stages):
        names = [s.name for s in df.stages[:number]]
        if stage.base in names:  # FROM an earlier stage: its Python
            base = stage_python[names.index(stage.base)]
        else:  # a base image: a fresh venv for its Python (one file system for all)
            base = f"{work}/base-{number}"
            runs = any(not SYSTEM_PACKAGES.search(i.text) for i in stage.all("RUN"))
            if runs or (stage is df.final and not stage.all("ENTRYPOINT")):
                lines.append(f"{python} -m venv {base}")
                held = BASE_PACKAGES.get(stage.base.rpartition(":")[0], ())
                reqs = [r for r in PROJECT["dependencies"] if Requirement(r).name in held]
                if reqs:
                    lines.append(f"{base}/bin/python -m pip install -q {shlex.join(reqs)}")
        stage_python.append(base)
        workdir, settings = "/", {"PATH": f"{base}/bin:{IMAGE_PATH}"}
        for ins in stage.instructions:
            if ins.keyword == "COPY" and "from" not in ins.flags:
                for src, dest in copies(ins, context):
                    target = shlex.quote(inside(dest))
                    lines.append(f'mkdir -p "$(dirname {target})"')
                    lines.append(f"cp -p {shlex.quote(f'{source}/{src}')} {target}")
            elif ins.keyword == "COPY":
                # One file system for every stage: a copy between stages is
                # checked, not made. A venv keeps its path (its scripts name
                # it), and its python is a link to the base image's
                # interpreter, which must then be the same image.
                *sources, dest = ins.words()
                origin = df.stage(ins.flags["from"])
                for src in sources:
                    assert posixpath.normpath(src) == posixpath.normpath(dest), (
                        f"{ins.where}: COPY --from {src} to another path, {dest}"
                    )
                    lines.append(f"test -e {shlex.quote(inside(src))}")
                assert origin.base == stage.base, f"{ins.where}: {origin.base} ≠ {stage.base}"
            elif ins.keyword == "RUN" and SYSTEM_PACKAGES.search(ins.text):
                # The base image's system packages (a compiler): the host's stand in.
                assert not re.search(r"\b(pip|python3?)\b", ins.text), (
                    f"{ins.where}: install system packages and Python packages in two RUNs"
                )
            elif ins.keyword == "RUN":
                # --no-cache-dir keeps pip's cache out of the image's layer;
                # here pip may reuse what an earlier run downloaded.
                command = inside(re.sub(r"\s--no-cache-dir\b", "", ins.text))
                env = [*CLEAN_ENV, *(f"{k}={v}" for k, v in settings.items())]
                run = shlex.join([*env, "/bin/sh", "-c", command])
                lines.append(f"(cd {shlex.quote(rootfs + workdir)} && {run})")
            elif ins.keyword == "WORKDIR":
                workdir = posixpath.join(workdir, ins.text)
                lines.append(f"mkdir -p {shlex.quote(rootfs + workdir)}")
            elif ins.keyword == "ENV":
                for setting in shlex.split(ins.text):
                    key, _, value = setting.partition("=")
                    settings[key] = inside(value)
    # The image as it runs, away from the source tree (the installed files
    # import): its ENTRYPOINT and the interpreter of the ENTRYPOINT's script,
    # else pleserver and python3 on its PATH.
    env = shlex.join([*CLEAN_ENV, f"PATH={stage_python[-1]}/bin:{IMAGE_PATH}"])
    entrypoints = df.final.all("ENTRYPOINT")
    if entrypoints:
        cli = shlex.quote(inside(entrypoints[-1].words()[0]))
        # pip writes `#!/bin/sh` and an exec line when the path is too long for `#!`.
        lines += [
            f"image_python=$(head -n1 {cli} | cut -c3-)",
            '[ "$image_python" != /bin/sh ] || '
            f"""image_python=$(sed -n '2s/^[^"]*"\\([^"]*\\)".*/\\1/p' {cli})""",
        ]
    else:
        cli = "pleserver"
        lines.append("image_python=python3")
    lines += [
        f"cd {work}/empty",
        f"{env} {cli} --version",
        f"""{env} "$image_python" - <<'PY'\n{WHEEL_CHECK}\n{IMAGE_CHECK}\nPY""",
    ]
    return "\n".join(lines) + "\n"


def check_report(output: str, name: str) -> dict:
    """What the build script printed: the CLI's version, both native modules
    from the image's Python, the plugin, the license and the deploy files."""
    lines = output.strip().splitlines()
    reports = [n for n, line in enumerate(lines) if line.startswith(REPORT)]
    assert reports and reports[-1] >= 2, f"{name}: no report\n{output[-4000:]}"
    report = json.loads(lines[reports[-1]][len(REPORT) :])
    assert lines[reports[-1] - 2] == f"pleserver {version('pleserver')}", f"{name}\n{output}"
    check_installed(lines[reports[-1] - 1], report["prefix"])
    assert report["plugins"] == ["pleserver_shm"], (name, report)
    assert any(f.endswith("/licenses/LICENSE") for f in report["licenses"]), (name, report)
    # The package's own copies, not a checkout's deploy/.
    assert report["deploy_dir"].startswith(report["prefix"] + "/"), (name, report)
    for f in deployfiles.FILES:
        wanted = hashlib.sha256((REPO / "deploy" / f.path).read_bytes()).hexdigest()
        assert report["deploy"][f.path] == wanted, (name, f.path)
    return report


@pytest.mark.images
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", DOCKERFILES)
def test_each_images_build_context_installs_and_imports_the_package(name, tmp_path):
    # The base image's Python: this interpreter's own, not this test's venv.
    python = getattr(sys, "_base_executable", sys.executable)
    script = build_script(
        dockerfile(name), checkout_context(name), str(REPO), str(tmp_path / "image"), python
    )
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, (
        f"{name} does not build from its context (exit {result.returncode}):\n"
        f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    )
    check_report(result.stdout, name)
