"""The launch leaves its user's process as it found it, and a misspelt class name stops it before any process starts.

Lightning's own tests check after every test that no environment variable was left behind; ours did leave the
launch's run id in ``os.environ``. The id now lives in the environment of the launch only.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap

import lightning as L
import pytest

from lightning_fastdist import FastDDPStrategy, FastFSDPStrategy
from lightning_fastdist.parallel.faults.job_identity import OWN_RUN_ID_VARIABLE
from tests.support.harness import run_launcher
from tests.support.workloads import make_trainer, repeated_batches, tiny_gpt

# What Lightning's own launcher sets in the launching process (its conftest allows them too); the fit must
# leave nothing else. Ours runs first: a second launch in the same process finds LOCAL_RANK set and starts nothing.
LIGHTNING_LAUNCH_VARIABLES = {"LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS"}
SCRIPT = """
    import os, sys
    sys.path.insert(0, {root!r})
    from lightning_fastdist import FastDDPStrategy
    from tests.support.workloads import make_trainer, repeated_batches, tiny_gpt

    before = dict(os.environ)
    trainer = make_trainer(FastDDPStrategy(), max_steps=1)
    trainer.fit(tiny_gpt(), repeated_batches())
    if trainer.global_rank == 0:
        print("CHANGED", sorted({{key for key, _ in set(before.items()) ^ set(os.environ.items())}}))
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_fit_leaves_the_environment_of_the_launching_process_as_it_found_it(tmp_path):
    script = tmp_path / "fit_twice.py"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script.write_text(textwrap.dedent(SCRIPT.format(root=root)))
    output = run_launcher([sys.executable, str(script)], timeout=240, cwd=tmp_path).stdout
    changed = set(json.loads(output.split("CHANGED ", 1)[1].splitlines()[0].replace("'", '"')))
    assert OWN_RUN_ID_VARIABLE not in changed and changed <= LIGHTNING_LAUNCH_VARIABLES, changed


@pytest.mark.parametrize("strategy", [FastDDPStrategy, FastFSDPStrategy])
def test_a_misspelt_block_is_raised_once_here_before_any_process_starts(strategy, monkeypatch):
    started: list[object] = []
    monkeypatch.setattr("subprocess.Popen", lambda *args, **kwargs: started.append(args))  # nothing may start
    environment = dict(os.environ)
    trainer = make_trainer(strategy(blocks=["Blok"]))
    with pytest.raises(ValueError, match="^blocks: 'Blok' matches no module class in TinyGPT; the classes found"):
        trainer.fit(tiny_gpt(), repeated_batches())
    assert started == [] and dict(os.environ) == environment and OWN_RUN_ID_VARIABLE not in os.environ


def test_a_model_that_builds_its_layers_in_configure_model_is_checked_at_setup_instead():
    class Deferred(L.LightningModule):
        def configure_model(self) -> None:
            pass

    FastFSDPStrategy(blocks=["Blok"]).check_names(Deferred())  # nothing to check yet: no error
