"""The package that installs the `nanoinfer` command: its license metadata is the SPDX form, which
setuptools builds without a deprecation warning, and the LICENSE file it names is Apache-2.0."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_license_is_an_spdx_expression_with_its_file():
    pyproject = _pyproject()
    assert pyproject["project"]["license"] == "Apache-2.0"
    assert pyproject["project"]["license-files"] == ["LICENSE"]
    # The string form needs setuptools 77 or later.
    assert "setuptools>=77" in pyproject["build-system"]["requires"]
    assert pyproject["project"]["scripts"]["nanoinfer"] == "nanoinfer.entrypoints.cli:main"


def test_license_file_is_the_apache_2_text():
    with open(os.path.join(ROOT, "LICENSE")) as f:
        text = f.read()
    assert text.lstrip().startswith("Apache License\n                           Version 2.0, January 2004")
    for clause in (
        "1. Definitions.",
        "2. Grant of Copyright License.",
        "9. Accepting Warranty or Additional",
    ):
        assert clause in text
    assert "END OF TERMS AND CONDITIONS" in text and "APPENDIX: How to apply the Apache License" in text


def test_setuptools_builds_the_metadata_without_warnings(tmp_path):
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__} predates SPDX license strings")
    # The metadata of a copy holding only what it reads (the package itself is found, not built).
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    (tmp_path / "nanoinfer").mkdir()
    (tmp_path / "nanoinfer" / "__init__.py").write_text("")
    (tmp_path / "out").mkdir()
    build = subprocess.run(
        [
            sys.executable,
            "-W",
            "always",
            "-c",
            "from setuptools import build_meta; print(build_meta.prepare_metadata_for_build_wheel('out'))",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert build.returncode == 0, build.stderr
    assert "Warning" not in build.stderr, build.stderr
    dist_info = build.stdout.strip().splitlines()[-1]
    metadata = (tmp_path / "out" / dist_info / "METADATA").read_text()
    assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata
