"""The build's one addition to pyproject.toml: compiled programs, which setuptools' ext-modules
cannot describe (they are executables, not modules). Each is listed in pyproject.toml's
``[tool.poprun-py] programs`` and built beside the extensions, with the same compiler (``CC``
where set: ``make dist``'s zig) and, like them, optional: where it does not build, the install
goes on without it and the program's Python fallback is used (``popcontract.compiled``)."""

from __future__ import annotations

import os
import shlex
import tomllib
from typing import Any

from setuptools import setup
from setuptools.command.build_ext import build_ext


def programs() -> list[dict[str, Any]]:
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "pyproject.toml"), "rb") as f:
        found: list[dict[str, Any]] = tomllib.load(f)["tool"]["poprun-py"]["programs"]
    return found


class BuildExtAndPrograms(build_ext):
    """build_ext, then each program of pyproject.toml into its package's folder (the source tree's
    for an in-place build, as ``pip install -e`` makes)."""

    def run(self) -> None:
        super().run()
        for program in programs():
            self.build_program(program)

    def build_program(self, program: dict[str, Any]) -> None:
        from distutils.errors import CCompilerError, DistutilsError

        package, _, name = program["name"].rpartition(".")
        folder = os.path.join(*package.split(".")) if self.inplace else os.path.join(self.build_lib,
                                                                                     *package.split("."))
        try:
            compiler = self.compiler
            objects = compiler.compile(program["sources"], output_dir=self.build_temp,
                                       extra_postargs=program.get("extra-compile-args", []))
            # LDFLAGS as for the extensions (distutils adds it to their link only): -fsanitize, --strip-debug
            flags = shlex.split(os.environ.get("LDFLAGS", ""))
            preferred = program.get("preferred-link-args", [])
            try:  # -static where the C library has its archive and no sanitizer is linked in
                compiler.link_executable(objects, name, output_dir=folder, extra_postargs=flags + preferred)
            except (CCompilerError, DistutilsError):
                if not preferred:
                    raise
                compiler.link_executable(objects, name, output_dir=folder, extra_postargs=flags)
        except (CCompilerError, DistutilsError, OSError) as exc:
            self.warn(f"building program '{program['name']}' failed: {exc}; the install uses its Python fallback")


setup(cmdclass={"build_ext": BuildExtAndPrograms})
