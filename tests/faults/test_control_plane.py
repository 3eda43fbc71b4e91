"""Nobody in: the listeners a job across nodes opens bind one address, serve a node's state only to the job, never run
what a peer sends, and refuse another job's processes in one line (``docs/security.md``).

One process each: a state transport, a register, a coordinator; a stranger is a plain request from this process, with
no job identity. The listeners of a real 2-node job and its coordinator are read from ``ss`` in
``tests/replica_groups/test_every_step.py`` (node 0 lost, with a coordinator).
"""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_fastdist.commands.coordinator import main as coordinator_main
from lightning_fastdist.parallel.across_nodes.state_transport import NodeStateTransport
from lightning_fastdist.parallel.faults.job_identity import JobIdentityError, claim_or_check_run_id
from lightning_fastdist.parallel.faults.listeners import PortInUseError, bound_store, job_address
from tests.support.harness import cli_command, free_port
from tests.support.listeners import listening_addresses, on_a_wildcard

TIMEOUT = timedelta(seconds=5)


def fetch(url: str, token: str | None = None) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def test_a_nodes_state_goes_only_to_a_request_naming_the_jobs_token_and_only_for_the_step_served():
    source = NodeStateTransport("127.0.0.1", "the job's token", TIMEOUT)
    healing = NodeStateTransport("127.0.0.1", "the job's token", TIMEOUT)
    try:
        state = {"weights": [torch.arange(6.0)], "optimizer": {"step": 3, "betas": (0.9, 0.999)}, "position": None}
        source.send_checkpoint([1], step=7, state_dict=state, timeout=TIMEOUT)
        url = source.metadata()
        assert "token" not in url  # torchft hands the metadata to anyone who asks a manager server
        for token in (None, "a guess", ""):
            status, body = fetch(f"{url}7", token)
            assert status == 403 and b"weights" not in body, (token, status)
        assert fetch(f"{url}6", "the job's token")[0] == 403  # another step
        assert source.refused == 4
        received = healing.recv_checkpoint(0, url, 7, TIMEOUT)
        assert torch.equal(received["weights"][0], torch.arange(6.0)) and received["optimizer"]["betas"] == (0.9, 0.999)
        assert healing.received_bytes == 6 * 4
        source.disallow_checkpoint()
        assert fetch(f"{url}7", "the job's token")[0] == 403  # served no longer: the state may change
    finally:
        source.shutdown()
        healing.shutdown()


class RunsCode:
    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_a_peer_that_sends_code_instead_of_state_runs_nothing_on_the_healing_node(tmp_path):
    marker = tmp_path / "ran"
    payload = RunsCode()
    payload.marker = str(marker)
    stranger = NodeStateTransport("127.0.0.1", "the job's token", TIMEOUT)  # a process that became the source
    healing = NodeStateTransport("127.0.0.1", "the job's token", TIMEOUT)
    try:
        buffer = io.BytesIO()
        torch.save({"weights": [payload]}, buffer)
        assert pickle.loads(pickle.dumps(payload)) is None and marker.exists()  # what unpickling it does
        marker.unlink()
        stranger.send_checkpoint([1], step=2, state_dict={"weights": [payload]}, timeout=TIMEOUT)
        with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
            healing.recv_checkpoint(0, stranger.metadata(), 2, TIMEOUT)
        assert not marker.exists()
    finally:
        stranger.shutdown()
        healing.shutdown()


def test_a_store_of_the_job_refuses_another_jobs_process_in_one_line_naming_it_and_both_ids():
    store = bound_store("127.0.0.1", 0, TIMEOUT, "the register")
    claim_or_check_run_id(store, "SLURM_JOB_ID=41", "the register at 127.0.0.1")  # the first claims it
    claim_or_check_run_id(store, "SLURM_JOB_ID=41", "the register at 127.0.0.1")  # the job's others pass
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=TIMEOUT)
    with pytest.raises(JobIdentityError) as refused:
        claim_or_check_run_id(client, "SLURM_JOB_ID=42", f"the register at 127.0.0.1:{store.port}")
    line = str(refused.value)
    assert "\n" not in line and f"127.0.0.1:{store.port}" in line
    assert "its run id is SLURM_JOB_ID=41, this process was launched as SLURM_JOB_ID=42" in line
    claim_or_check_run_id(client, None, "the register")  # launched without an id: it cannot tell, and is let in


def test_listeners_bind_the_address_on_the_route_to_the_job_and_a_taken_port_is_one_line():
    assert job_address("127.0.0.1") == "127.0.0.1"
    store = bound_store(job_address("127.0.0.1"), 0, TIMEOUT, "node0's store")
    assert listening_addresses([os.getpid()]).count(f"127.0.0.1:{store.port}") == 1
    with pytest.raises(PortInUseError, match=rf"^node1's store cannot listen on 127.0.0.1:{store.port}: .*another job"):
        bound_store("127.0.0.1", store.port, TIMEOUT, "node1's store")


@pytest.mark.multiprocess
def test_the_coordinator_listens_on_its_address_only_and_stops_at_sigterm():
    port = free_port()
    coordinator = subprocess.Popen(
        cli_command("coordinator", "--port", str(port), "--min-nodes", "1", "--bind", "127.0.0.1", "--run-id", "j1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert f"LIGHTNING_FASTDIST_COORDINATOR=127.0.0.1:{port}" in coordinator.stdout.readline()
        listening = listening_addresses([coordinator.pid])
        assert f"127.0.0.1:{port}" in listening and len(listening) == 2 and on_a_wildcard(listening) == []
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
        with pytest.raises(JobIdentityError, match="its run id is j1, this process was launched as j2"):
            claim_or_check_run_id(client, "j2", "the coordinator's register")
        coordinator.terminate()
        assert coordinator.wait(timeout=30) == 0 and "stopped" in coordinator.stdout.read()
    finally:
        coordinator.kill()
        coordinator.wait()


def test_a_port_the_coordinator_cannot_have_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as ended:
        coordinator_main(["--port", "65536", "--min-nodes", "1"])
    assert ended.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith("--port: must be a port, 1 to 65535, got 65536")
    taken = bound_store("127.0.0.1", 0, TIMEOUT, "a user's server")
    with pytest.raises(SystemExit) as ended:
        coordinator_main(["--port", str(taken.port), "--min-nodes", "1", "--bind", "127.0.0.1"])
    assert ended.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("lightning-fastdist coordinator: error: --port: lightning-fastdist coordinator's register")
