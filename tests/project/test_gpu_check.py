"""benchmarks/gpu_check.sh and gpu_check.py without a GPU: nothing fetched, one report, a line per check.

The slow test runs the shell script for real on the CPU (``--device cpu``): it installs a wheel made here
with pip's index pointed at nothing, runs a check that passes, one that fails on purpose and skips the
CUDA-only ones with their reason, and leaves the JSON report and the log.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.support.offline_gpu_script import load_driver, offline_environment, shell_commands

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def test_every_pip_install_is_offline_and_nothing_else_fetches():
    installs = [command for command in shell_commands(SCRIPT) if "pip install" in command]
    assert installs and all("--no-index" in command and "--no-deps" in command for command in installs)
    assert not [c for c in shell_commands(SCRIPT) if re.search(r"\b(pip download|curl|wget|git clone)\b", c)]
    for python_file in ("gpu_check.py", "gpu_check_cases.py"):
        assert "pip" not in (ROOT / "benchmarks" / python_file).read_text()


def test_the_make_target_prepares_python_312_wheels_into_an_ignored_folder():
    dry = subprocess.run(["make", "-n", "gpu-wheels"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "--only-binary=:all: --python-version 3.12" in dry and "pip wheel" in dry and "deepspeed" in dry
    assert ".gpu-wheels/" in (ROOT / ".gitignore").read_text().splitlines()


def test_the_runner_lists_its_checks_and_refuses_an_unknown_one_in_one_line(capsys):
    runner = load_driver("gpu_check")
    assert runner.main(["--list"]) == 0
    listed = capsys.readouterr().out
    for name in ("mfu", "host_syncs", "amp_fp16", "comm_hooks", "powersgd_resume", "fsdp_modes", "fsdp_checkpoints",
                 "compile_inductor", "cuda_graph_modes", "deepspeed", "deepspeed_offload"):  # fmt: skip
        assert name in listed
    assert runner.main(["--device", "cpu", "--only", "mfu,nope"]) == 2
    assert capsys.readouterr().out.startswith("--only: unknown check(s) nope; the checks: mfu, host_syncs")


def test_a_check_the_budget_cut_short_is_skipped_and_one_past_its_own_limit_failed(tmp_path):
    # A child killed because the run's budget ran out has shown nothing wrong; one that outran its own limit has.
    runner = load_driver("gpu_check")
    arguments = runner.parse_arguments(["--device", "cpu"])
    with open(tmp_path / "log", "w") as log:
        cut = runner.run_child(runner.Check("host_syncs", 120), arguments, "cpu", 4, log, seconds=0.2)
        late = runner.run_child(runner.Check("host_syncs", 0.2), arguments, "cpu", 4, log, seconds=0.2)
    assert (cut.status, late.status) == ("SKIP", "FAIL")
    assert cut.detail.startswith("cut short by the budget after 0 s (its limit: 120 s)")


@pytest.mark.slow
def test_the_script_runs_on_cpu_offline_with_one_report_and_a_line_per_check(tmp_path):
    out = tmp_path / "out"
    environment, probe = offline_environment(tmp_path)
    command = ["bash", str(SCRIPT), "--device", "cpu", "--out", str(out), "--only", "mfu,cuda_graph_modes,rng_states",
               "--inject-failure"]  # fmt: skip
    done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if re.match(r"\[(PASS|FAIL|SKIP)\] ", line)]
    assert done.returncode == 1, done.stdout + done.stderr  # the injected failure, and nothing else, failed
    assert (probe / "__init__.py").exists()  # installed with --no-index
    assert lines[0] == "[SKIP] mfu: needs CUDA: MFU is measured against a GPU's peak FLOPs"
    assert "[SKIP] host_syncs: not selected (--only)" in lines
    assert "[SKIP] rng_states: needs CUDA: it restores a CUDA generator" in lines
    assert any(line.startswith("[PASS] cuda_graph_modes: refused at construction in one line") for line in lines)
    assert lines[-1].startswith("[FAIL] injected_failure: RuntimeError: injected by --inject-failure")
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["summary"] == {"PASS": 1, "FAIL": 1, "SKIP": len(lines) - 2} and report["device"] == "cpu"
    graphs = next(check for check in report["checks"] if check["name"] == "cuda_graph_modes")
    assert "max-autotune-no-cudagraphs" in graphs["numbers"]["refusal_ac_full"]
    assert "Traceback" in (out / "gpu_check.log").read_text()  # the failing check's traceback, for the record


def test_without_gpu_site_the_wheels_go_into_a_private_folder_that_is_removed(tmp_path):
    # A predictable /tmp folder on PYTHONPATH would import whatever another user of the machine put there.
    environment, _ = offline_environment(tmp_path)
    del environment["GPU_SITE"]
    environment["TMPDIR"] = str(tmp_path / "private")
    (tmp_path / "private").mkdir()
    probe = "import fastdist_offline_probe; print('FROM', fastdist_offline_probe.__file__)"
    runner = f'source benchmarks/offline_site.sh "no wheels"; trap remove_offline_site EXIT; "$PYTHON" -c "{probe}"'
    done = subprocess.run(["bash", "-c", runner], cwd=ROOT, env=environment, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    imported_from = Path(done.stdout.split("FROM ", 1)[1].strip())
    assert imported_from.is_relative_to(tmp_path / "private")  # mktemp -d: a fresh folder only its owner can enter
    assert list((tmp_path / "private").iterdir()) == []  # removed at the end
