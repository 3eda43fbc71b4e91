"""Where a launch's run id comes from: the id every store of the job is claimed for. A second job started on the
port of a running one is a trial of the fault campaign (``tests/faults/test_fault_campaign.py``): its ranks are
refused in one line each, the running job trains on."""

from __future__ import annotations

from lightning_fastdist.parallel.faults.job_identity import launch_run_id


def test_the_run_id_comes_from_the_launcher():
    assert (
        launch_run_id({"LIGHTNING_FASTDIST_RUN_ID": "abc", "TORCHELASTIC_RUN_ID": "x"})
        == "LIGHTNING_FASTDIST_RUN_ID=abc"
    )
    assert launch_run_id({"TORCHELASTIC_RUN_ID": "none"}) is None  # torchrun's default id names no launch
    assert launch_run_id({"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "2"}) == "SLURM_JOB_ID=77.2"
    assert launch_run_id({}) is None
