"""Lightning's own strategy tests with our strategies substituted: one summary line and the failing test ids.

    python benchmarks/lightning_strategy_tests.py --lightning-git /path/to/pytorch-lightning/.git
    python benchmarks/lightning_strategy_tests.py --lightning-src /path/to/pytorch-lightning  # a checkout
    python benchmarks/lightning_strategy_tests.py --lightning-git DIR --ref 2.6.5 --keep  # keep the copy
    python benchmarks/lightning_strategy_tests.py --lightning-git DIR --control  # Lightning's own classes

It copies Lightning's ``tests/tests_pytorch`` (from a git directory at ``--ref``, or from a checkout as it is)
and Lightning's ``pyproject.toml`` (its pytest options) into a temporary folder; nothing of Lightning's is kept in
this repository. In the copy, five of the six files import ours under Lightning's names: ``FastDDPStrategy as
DDPStrategy`` in ``strategies/test_ddp.py``, ``test_ddp_integration.py``, ``test_ddp_integration_comm_hook.py`` and
``launchers/test_multiprocessing.py``, ``FastFSDPStrategy as ModelParallelStrategy`` in ``test_model_parallel.py``;
``test_common.py`` imports no strategy class and runs unchanged. The import lines are rewritten
rather than patched at run time so that a process started with ``start_method="spawn"``, which imports the
test module afresh, gets our class too. Lightning's own conftest stays in force (it fails a test that leaves an
environment variable, a thread or a file behind). ``strategy="ddp"`` from the registry is still Lightning's
class, so ``test_ddp_cpu`` fails by construction; docs/migration.md lists the other failures and why.
``--control`` runs the same files unchanged, with Lightning's classes: what fails there is this machine's, not ours.

The installed Lightning should be the version the tests come from: without ``--ref`` the newest tag not newer
than the installed version is used, and a line says when they differ.

Lightning's test-only packages these six files need (requirements/pytorch/test.txt), installed with pip:
``scikit-learn`` (``ClassifDataModule``) and ``pytest-rerunfailures`` (the ``flaky`` marker):

    .venv/bin/pip install "scikit-learn>0.22.1,<1.9.0" "pytest-rerunfailures==16.1"

Not a part of our suite (benchmarks/, not tests/): it needs Lightning's source, which CI does not have.
Exit status: 0 when the run completed (whatever failed), 2 when it could not run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from importlib.util import find_spec
from pathlib import Path

# module -> the pip requirement (Lightning's pin) of each test-only package the six files need
TEST_PACKAGES = {"sklearn": "scikit-learn>0.22.1,<1.9.0", "pytest_rerunfailures": "pytest-rerunfailures==16.1"}
STRATEGY_TESTS = "tests/tests_pytorch/strategies"
# (Lightning's import line, ours under the same name)
DDP = (
    "from lightning.pytorch.strategies import DDPStrategy\n",
    "from lightning_fastdist import FastDDPStrategy as DDPStrategy\n",
)
MODEL_PARALLEL = (
    "from lightning.pytorch.strategies import ModelParallelStrategy\n",
    "from lightning_fastdist import FastFSDPStrategy as ModelParallelStrategy\n",
)
# The six files, each with its substitution (None: it imports no strategy and runs unchanged).
TEST_FILES: dict[str, tuple[str, str] | None] = {
    "test_ddp.py": DDP,
    "test_ddp_integration.py": DDP,
    "test_ddp_integration_comm_hook.py": DDP,
    "test_common.py": None,
    "launchers/test_multiprocessing.py": DDP,
    "test_model_parallel.py": MODEL_PARALLEL,
}

# A pytest plugin (loaded with -p) that writes each test's outcome: setup, call and teardown together.
OUTCOME_PLUGIN = """
import json, os

_outcomes = {}

def pytest_runtest_logreport(report):
    if report.failed and not _outcomes.get(report.nodeid, "").startswith("failed"):
        _outcomes[report.nodeid] = "failed" if report.when == "call" else f"failed ({report.when})"
    elif report.skipped and report.nodeid not in _outcomes:
        _outcomes[report.nodeid] = "skipped"
    elif report.when == "call" and report.passed and report.nodeid not in _outcomes:
        _outcomes[report.nodeid] = "passed"

def pytest_collectreport(report):
    if report.failed:
        _outcomes[report.nodeid] = "failed (collection)"

def pytest_sessionfinish(session):
    with open(os.environ["LIGHTNING_STRATEGY_TESTS_OUTCOMES"], "w") as f:
        json.dump(_outcomes, f)
"""


def _version_key(tag: str) -> tuple[int, ...] | None:
    match = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)", tag)
    return tuple(int(part) for part in match.groups()) if match else None


def _pick_ref(git_dir: Path, installed: str) -> str:
    """The newest release tag not newer than the installed Lightning."""
    tags = subprocess.run(
        ["git", "--git-dir", str(git_dir), "tag", "--list"], check=True, capture_output=True, text=True
    ).stdout.split()
    installed_key = _version_key(installed)
    releases = [
        tag for tag in tags if _version_key(tag) and (installed_key is None or _version_key(tag) <= installed_key)
    ]
    if not releases:
        raise SystemExit(f"no release tag in {git_dir} up to the installed lightning {installed}; pass --ref")
    return max(releases, key=_version_key)


def _extract(args: argparse.Namespace, into: Path, installed: str) -> str:
    """Copy Lightning's tests and pytest options into ``into``; return the version they come from."""
    if args.lightning_src:
        source = Path(args.lightning_src)
        shutil.copytree(source / "tests" / "tests_pytorch", into / "tests" / "tests_pytorch")
        shutil.copy(source / "pyproject.toml", into / "pyproject.toml")
        version_file = source / "src" / "version.info"
        return version_file.read_text().strip() if version_file.exists() else "the checkout"
    git_dir = Path(args.lightning_git)
    ref = args.ref or _pick_ref(git_dir, installed)
    archive = subprocess.run(
        ["git", "--git-dir", str(git_dir), "archive", ref, "tests/tests_pytorch", "pyproject.toml"],
        capture_output=True,
    )
    if archive.returncode != 0:
        raise SystemExit(f"git archive {ref} failed: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return ref


def _substitute(strategies: Path) -> None:
    for name, substitution in TEST_FILES.items():
        if substitution is None:
            continue
        path, (theirs, ours) = strategies / name, substitution
        text = path.read_text()
        if text.count(theirs) != 1:
            raise SystemExit(f"{name}: expected the line {theirs.strip()!r} once; Lightning's tests changed")
        path.write_text(text.replace(theirs, ours))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--lightning-git", help="Lightning's git directory (a bare mirror or a checkout's .git)")
    source.add_argument("--lightning-src", help="a checkout of Lightning, used as it is")
    parser.add_argument("--ref", help="the tag or commit to take the tests from (--lightning-git only)")
    parser.add_argument("--control", action="store_true", help="run with Lightning's own classes (no substitution)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per test before pytest-timeout stops it")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder and print its path")
    args = parser.parse_args(argv)

    missing = [requirement for module, requirement in TEST_PACKAGES.items() if find_spec(module) is None]
    if missing:
        print("Lightning's tests need: pip install " + " ".join(f'"{requirement}"' for requirement in missing))
        return 2
    import lightning

    installed = lightning.__version__
    started = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="lightning_strategy_tests_"))
    try:
        tests_from = _extract(args, root, installed)
        if tests_from.lstrip("v") != installed:
            print(f"note: the tests are Lightning {tests_from}'s, the installed lightning is {installed}")
        strategies = root / STRATEGY_TESTS
        if not args.control:
            _substitute(strategies)
        (root / "_strategy_test_outcomes.py").write_text(OUTCOME_PLUGIN)
        outcomes_file = root / "outcomes.json"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
            "LIGHTNING_STRATEGY_TESTS_OUTCOMES": str(outcomes_file),
        }
        # From tests/ with Lightning's pyproject.toml as the configuration, as Lightning's CI runs them.
        files = [f"tests_pytorch/strategies/{name}" for name in TEST_FILES]
        command = [sys.executable, "-m", "pytest", "-q", "--color=no", "-p", "no:cacheprovider"]
        command += ["-p", "_strategy_test_outcomes", f"--timeout={args.timeout}", *files]
        run = subprocess.run(command, cwd=root / "tests", env=env, capture_output=True, text=True)
        if run.returncode not in (0, 1) or not outcomes_file.exists():  # 1: some tests failed
            print(run.stdout[-6000:], run.stderr[-6000:], sep="\n")
            print(f"pytest did not complete the run (exit status {run.returncode})")
            return 2
        outcomes = json.loads(outcomes_file.read_text())
    finally:
        if args.keep:
            print(f"kept: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)

    counts = {kind: sum(o.startswith(kind) for o in outcomes.values()) for kind in ("passed", "failed", "skipped")}
    print(f"passed {counts['passed']}, failed {counts['failed']}, skipped {counts['skipped']}")
    for test_id, outcome in outcomes.items():
        if outcome.startswith("failed"):
            print(f"  {test_id}" + (f"  {outcome}" if outcome != "failed" else ""))
    print(f"({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
