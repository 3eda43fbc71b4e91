"""What the tests of the prepared GPU scripts (``benchmarks/gpu_check.sh``, ``gpu_bench.sh``) give them on CPU: their
Python driver as a module, and a folder of wheels holding one wheel made here, a site folder to install it into and
an index no request can reach, so that a run shows the script installs what it is given and fetches nothing."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import zipfile
from pathlib import Path
from types import ModuleType

PROBE = "fastdist_offline_probe"
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
_SOURCED = re.compile(r"^source benchmarks/(\S+\.sh)\b")


def shell_commands(path: Path) -> list[str]:
    """The script's commands, continuation lines joined, comments dropped, and those of the scripts it sources from
    ``benchmarks/`` in their place."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    commands = []
    for line in (line.strip() for line in text.splitlines()):
        if not line or line.startswith("#"):
            continue
        sourced = _SOURCED.match(line)
        commands += shell_commands(BENCHMARKS / sourced.group(1)) if sourced else [line]
    return commands


def load_driver(name: str) -> ModuleType:
    """``benchmarks/NAME.py`` (not a package) imported as the module ``NAME``."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def tiny_wheel(folder: Path) -> Path:
    """A one-module wheel (``fastdist_offline_probe``) written into ``folder``."""
    wheel = folder / f"{PROBE}-0.1-py3-none-any.whl"
    files = {
        f"{PROBE}/__init__.py": "VALUE = 1\n",
        f"{PROBE}-0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: fastdist-offline-probe\nVersion: 0.1\n",
        f"{PROBE}-0.1.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{PROBE}-0.1.dist-info/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, text in {**files, f"{PROBE}-0.1.dist-info/RECORD": record}.items():
            archive.writestr(name, text)
    return wheel


def offline_environment(folder: Path) -> tuple[dict[str, str], Path]:
    """The environment of a script run offline from ``folder``, and the site folder it installs the probe into
    (``site / "fastdist_offline_probe"`` exists after an install with ``--no-index``)."""
    wheels, site = folder / "wheels", folder / "site"
    wheels.mkdir()
    tiny_wheel(wheels)
    environment = {**os.environ, "PYTHON": sys.executable, "GPU_WHEELS": str(wheels), "GPU_SITE": str(site),
                   "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_RETRIES": "0"}  # fmt: skip
    return environment, site / PROBE
