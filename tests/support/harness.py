"""Run code in several real CPU processes that talk over gloo, the way users launch them.

Entry points, all with a free port, a timeout, clean teardown (a hung
rank is killed with its whole process group) and the failing rank's error in
the test failure:

- :func:`run_function`: a picklable function in N processes (forked from a
  server that imported torch once), with the process group already
  initialised (or left to Lightning).
- :func:`run_command` / :func:`run_cli`: a command in N processes with the
  environment ``torchrun`` would give them (``RANK``, ``WORLD_SIZE``, ...).
- :func:`run_cli_forked`: ``lightning-fastdist`` in N processes with that environment,
  forked from the same server as :func:`run_function` (no start-up of their own).
- :func:`run_launcher`: one command that launches its own ranks (Lightning's
  ``devices=2``), killed as a group on timeout.
- :func:`run_processes`: different commands at once, e.g. one ``torchrun`` per "node"; with ``forked=True``,
  ``python -m MODULE ...`` commands are forked from that server (:class:`ForkedModule`).
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import os
import pickle
import queue
import random
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

# Seconds a rank may keep running after another rank failed (to flush its output).
FAILURE_GRACE_SECONDS = 3.0
# Characters of each failing rank's output shown in the error.
OUTPUT_TAIL_CHARS = 4000


class DistributedRunError(AssertionError):
    """One or more ranks failed or timed out; the message holds their errors."""


@dataclass
class RankOutput:
    """What one rank of :func:`run_command` left behind."""

    rank: int
    returncode: int | None
    stdout: str
    stderr: str


# free_port and rank_environment repeat lightning_fastdist.commands.local_ranks' on purpose: importing anything
# from the package imports Lightning (about 8 s), and `python -m tests.support.emulated_cluster` imports this module.
def free_port() -> int:
    """A TCP port that was free a moment ago, below the kernel's range for outgoing connections: a port the kernel
    handed out (a bind to port 0) can be taken by any process's next connection before the job binds it (in an idle
    full run, the DeepSpeed module's, while the Ray cluster started beside it)."""
    return free_port_span(1)


def free_port_span(count: int) -> int:
    """The first of ``count`` consecutive TCP ports that were free a moment ago on every interface, below the
    kernel's range of ports it hands out to outgoing connections (a job that binds ``MASTER_PORT + k``, as
    ``outer_sync`` does for its lighthouse and node stores, would otherwise race another test's connections)."""
    generator = random.Random()
    while True:
        first = generator.randrange(20000, 32000 - count)
        with contextlib.ExitStack() as held:
            try:
                for port in range(first, first + count):
                    sock = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                    sock.bind(("", port))
            except OSError:
                continue
        return first


def rank_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables ``torchrun`` sets for one local rank on a single node."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "NODE_RANK": "0",
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world_size)),
    }


def _tail(text: str) -> str:
    return text if len(text) <= OUTPUT_TAIL_CHARS else "...\n" + text[-OUTPUT_TAIL_CHARS:]


# ---------------------------------------------------------------- functions

# Ranks of run_function are forked from one server process that imported torch, Lightning and
# this package once, instead of each spawned rank importing them again (about 4 s of CPU per
# rank, on every run). Like spawn, a rank starts in the caller's working directory with its
# sys.path (multiprocessing sends both) and its environment (passed by _function_entry).
_RANK_STARTER = multiprocessing.get_context("forkserver")
_RANK_STARTER.set_forkserver_preload(["torch", "torch.distributed", "lightning.pytorch", "lightning_fastdist"])


def _function_entry(
    fn: Callable[..., Any],
    args: tuple,
    rank: int,
    world_size: int,
    port: int,
    init_process_group: bool,
    timeout_seconds: float,
    results: multiprocessing.Queue,
    environment: dict[str, str],
) -> None:
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(rank_environment(rank, world_size, port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:
        if init_process_group:
            dist.init_process_group(
                "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_seconds)
            )
        # Plain pickle copies tensor data; the queue's own pickler would pass tensors
        # through shared memory that vanishes when this process exits.
        results.put((rank, "ok", pickle.dumps(fn(*args))))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_function(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: Sequence[Any] = (),
    timeout: float = 120.0,
    init_process_group: bool = True,
) -> list[Any]:
    """Call ``fn(*args)`` in ``world_size`` new processes and return each rank's result, by rank.

    Args:
        fn: a module-level (picklable) function; it reads its rank from
            ``torch.distributed`` or ``os.environ["RANK"]``.
        world_size: number of processes.
        args: positional arguments, the same for every rank (picklable).
        timeout: seconds for the whole run; then every rank is killed.
        init_process_group: initialise a gloo process group before calling
            ``fn``; pass ``False`` when ``fn`` runs a Lightning Trainer, which
            initialises its own from the environment.
    """
    results = _RANK_STARTER.Queue()
    port = free_port()
    environment = dict(os.environ)
    processes = [
        _RANK_STARTER.Process(
            target=_function_entry,
            args=(fn, tuple(args), rank, world_size, port, init_process_group, timeout, results, environment),
            daemon=False,
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    outputs: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) + len(errors) < world_size and time.monotonic() < deadline:
            try:
                rank, status, payload = results.get(timeout=0.2)
                if status == "ok":
                    outputs[rank] = pickle.loads(payload)
                else:
                    errors[rank] = payload
            except queue.Empty:
                for rank, process in enumerate(processes):
                    silent = rank not in outputs and rank not in errors
                    if silent and process.exitcode not in (None, 0):
                        errors[rank] = f"process died with exit code {process.exitcode} before reporting"
            if errors:
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_SECONDS)
    finally:
        given_up = errors or time.monotonic() >= deadline  # a hung rank is not waited for again
        for process in processes:
            process.join(timeout=0.5 if given_up else 10)
            if process.is_alive():
                process.kill()
                process.join()
    missing = sorted(set(range(world_size)) - outputs.keys() - errors.keys())
    if errors or missing:
        parts = [f"--- rank {rank} failed:\n{_tail(text)}" for rank, text in sorted(errors.items())]
        parts += [f"--- rank {rank} did not finish within the time allowed (killed)" for rank in missing]
        raise DistributedRunError(f"{fn.__name__} failed on {world_size} processes:\n" + "\n".join(parts))
    return [outputs[rank] for rank in range(world_size)]


def _module_entry(
    module: str,
    args: list[str],
    environment: dict[str, str],
    cwd: str,
    out: str,
    err: str,
    prepare: Callable[[], None] | None,
) -> None:
    """``python -m MODULE ARGS`` in this forked process: its own session, environment, directory and output files,
    after ``prepare()`` where given."""
    os.setsid()  # as start_new_session: the test kills the process with whatever it started
    if prepare is not None:
        prepare()
    os.environ.clear()
    os.environ.update(environment)
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):  # file descriptors, so that C code and child processes write there too
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own stdout
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own stderr
    import torch

    if "OMP_NUM_THREADS" in environment:  # read by a fresh process's torch at import; this one imported it before
        torch.set_num_threads(int(environment["OMP_NUM_THREADS"]))
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        for stream in (sys.stdout, sys.stderr):
            if not stream.closed:  # a module may close them, as json.tool does
                stream.flush()


class ForkedModule:
    """``python -m MODULE ARGS`` (``command``) forked from :func:`run_function`'s server instead of started afresh:
    about 4 s of CPU less per process, for processes whose start-up is not what a test checks. ``env`` is its whole
    environment. Its output goes to the files ``out`` and ``err`` (by default two of its own, which
    :meth:`communicate` reads); ``pid``, ``poll``, ``wait``, ``communicate`` and ``returncode`` are
    :class:`subprocess.Popen`'s (a negative status for a signal, the status ``sys.exit`` gave otherwise). Python's
    ``atexit`` handlers do not run at its exit (it ends as a multiprocessing child does). ``prepare`` (picklable) is
    called in the new process before the module runs (to enter an emulated node's namespaces)."""

    stderr = None  # no pipe to read while it runs

    def __init__(
        self,
        command: Sequence[str],
        env: dict[str, str],
        cwd: str | Path | None = None,
        out: Path | None = None,
        err: Path | None = None,
        prepare: Callable[[], None] | None = None,
    ):
        if list(command[:2]) != [sys.executable, "-m"]:
            raise ValueError(f"ForkedModule runs `{sys.executable} -m MODULE ...`, not {' '.join(command)}")
        if out is None or err is None:
            self._folder = tempfile.TemporaryDirectory(prefix="fastdist-forked-")  # removed with this object
            out, err = Path(self._folder.name, "out"), Path(self._folder.name, "err")
        self._files = (out, err)
        arguments = (command[2], list(command[3:]), env, str(cwd or os.getcwd()), str(out), str(err), prepare)
        self._process = _RANK_STARTER.Process(target=_module_entry, args=arguments, daemon=False)
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"-m {self._process.name}", timeout)
        return self._process.exitcode

    def wait_for_session(self, deadline: float | None) -> None:
        """Wait until nothing it started is left (its session: a launcher's other ranks may write their output after
        it exited), or until ``deadline`` (:func:`wait_for_session_end`)."""
        wait_for_session_end(self.pid, deadline)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Wait for it and what it started to end (:meth:`wait_for_session`); its stdout and stderr."""
        deadline = time.monotonic() + timeout if timeout is not None else None
        self.wait(timeout)
        self.wait_for_session(deadline)
        out, err = self._files
        return out.read_text() if out.exists() else "", err.read_text() if err.exists() else ""


# ---------------------------------------------------------------- commands


def session_members(sessions: Iterable[int]) -> list[int]:
    """The live processes (not zombies) of the sessions ``sessions`` (each led by the process of that id)."""
    wanted, members = set(sessions), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) in wanted and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def wait_for_session_end(session: int, deadline: float | None) -> None:
    """Wait until ``session`` has no live process (a killed one is gone once the kernel has ended it), or until
    ``deadline`` (``time.monotonic()``; then what is left is not waited for)."""
    while session_members([session]) and (deadline is None or time.monotonic() < deadline):
        time.sleep(0.05)


def _kill_group(process: subprocess.Popen) -> None:
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


def run_command(
    command: Sequence[str],
    world_size: int = 2,
    timeout: float = 180.0,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
) -> list[RankOutput]:
    """Run ``command`` as ``world_size`` ranks with torchrun's environment; return their outputs.

    Raises :class:`DistributedRunError` with every failing rank's output if a
    rank exits non-zero or the run exceeds ``timeout`` seconds.

    Args:
        command: the program and its arguments, the same for every rank.
        world_size: number of processes.
        timeout: seconds for the whole run; then every rank is killed.
        env: extra environment variables for every rank.
        cwd: working directory of every rank.
    """
    port = free_port()
    environments = [{**(env or {}), **rank_environment(rank, world_size, port)} for rank in range(world_size)]
    return run_processes([list(command)] * world_size, environments, timeout=timeout, cwd=cwd)


def run_processes(
    commands: Sequence[Sequence[str]],
    environments: Sequence[dict[str, str]] | None = None,
    timeout: float = 180.0,
    cwd: str | Path | None = None,
    forked: bool = False,
    prepares: Sequence[Callable[[], None] | None] | None = None,
) -> list[RankOutput]:
    """Run several commands at once (for example one launcher per "node"); return their outputs in order.

    One failing command gets the others killed after a short grace period;
    :class:`DistributedRunError` then shows every failed command's output.

    Args:
        commands: one command line per process.
        environments: extra environment variables per process (added to this one's).
        timeout: seconds for the whole run; then every process is killed with its children.
        cwd: working directory of every process.
        forked: the commands are ``python -m MODULE ...``, each run as a :class:`ForkedModule`.
        prepares: with ``forked``, each command's ``prepare`` (:class:`ForkedModule`).
    """
    environments = environments or [{}] * len(commands)
    prepares = prepares or [None] * len(commands)
    with tempfile.TemporaryDirectory(prefix="fastdist-ranks-") as log_dir:
        processes, files = [], []
        for index, (command, extra_env) in enumerate(zip(commands, environments)):
            stdout = open(Path(log_dir, f"{index}.out"), "w+")  # noqa: SIM115 - closed below
            stderr = open(Path(log_dir, f"{index}.err"), "w+")  # noqa: SIM115 - closed below
            files.append((stdout, stderr))
            environment = {**os.environ, **extra_env}
            if forked:
                files_of_its_own = (Path(stdout.name), Path(stderr.name))
                processes.append(ForkedModule(command, environment, cwd, *files_of_its_own, prepare=prepares[index]))
                continue
            processes.append(
                subprocess.Popen(
                    list(command), stdout=stdout, stderr=stderr, env=environment, cwd=cwd, start_new_session=True
                )
            )
        deadline = time.monotonic() + timeout
        timed_out = _wait_all(processes, timeout)
        for process in processes:
            if isinstance(process, ForkedModule) and process.returncode == 0:
                process.wait_for_session(deadline)  # its other ranks write their output too
            _kill_group(process)
        outputs = []
        for index, (stdout, stderr) in enumerate(files):
            stdout.seek(0)
            stderr.seek(0)
            outputs.append(RankOutput(index, processes[index].returncode, stdout.read(), stderr.read()))
            stdout.close()
            stderr.close()
    failed = [o for o in outputs if o.returncode != 0]
    if timed_out or failed:
        reason = f"timed out after {timeout:.0f} s" if timed_out else "failed"
        label = " ".join(commands[0]) + (
            f" (and {len(commands) - 1} more)" if len(set(map(tuple, commands))) > 1 else ""
        )
        raise DistributedRunError(f"{label} {reason} on {len(commands)} processes:\n" + _failures(failed))
    return outputs


def _failures(failed: list[RankOutput]) -> str:
    """Each failed rank's exit status and the tail of its output, for a :class:`DistributedRunError`."""
    return "\n".join(f"--- rank {o.rank} (exit {o.returncode}):\n{_tail(o.stdout + o.stderr)}" for o in failed)


def _wait_all(processes: list[subprocess.Popen], timeout: float) -> bool:
    """Wait until all exit, or one fails (plus a grace period), or ``timeout``; True if it timed out."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in processes]
        if all(code is not None for code in codes):
            return False
        failed = any(code not in (None, 0) for code in codes)
        if failed:
            deadline = min(deadline, time.monotonic() + FAILURE_GRACE_SECONDS)
        if time.monotonic() >= deadline:
            return not failed
        time.sleep(0.05)


def cli_command(*args: str) -> list[str]:
    """The ``lightning-fastdist`` console script of this environment, with ``args``."""
    script = Path(sys.executable).with_name("lightning-fastdist")
    return [str(script), *args]


def run_cli(
    args: Sequence[str], world_size: int = 2, timeout: float = 180.0, cwd: str | Path | None = None
) -> list[RankOutput]:
    """Run ``lightning-fastdist ARGS`` as ``world_size`` externally launched ranks (as under torchrun)."""
    return run_command(cli_command(*args), world_size=world_size, timeout=timeout, cwd=cwd)


def _cli_in(folder: str, argv: list[str]) -> tuple[int, str, str]:
    """``lightning-fastdist ARGV`` run from ``folder`` in this process: its exit status, stdout and stderr."""
    from lightning_fastdist.cli import main

    os.chdir(folder)
    stdout, stderr, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            main(argv)
        except SystemExit as done:
            code = 0 if done.code is None else done.code
    return code, stdout.getvalue(), stderr.getvalue()


def run_cli_forked(
    args: Sequence[str],
    world_size: int = 2,
    timeout: float = 180.0,
    cwd: str | Path | None = None,
    check: bool = True,
) -> list[RankOutput]:
    """Run ``lightning-fastdist ARGS`` as ``world_size`` ranks, like :func:`run_cli`, each forked from the server
    that imported torch, Lightning and this package once: about 8 s of start-up less per rank, for runs whose
    start-up is not what a test checks (a resume after a fresh fit, a refusal).

    ``check``: raise :class:`DistributedRunError` if a rank exits non-zero (else its status is in its output).
    """
    folder = str(cwd or os.getcwd())
    results = run_function(_cli_in, world_size, (folder, list(args)), timeout=timeout, init_process_group=False)
    outputs = [RankOutput(rank, code, stdout, stderr) for rank, (code, stdout, stderr) in enumerate(results)]
    failed = [o for o in outputs if o.returncode != 0] if check else []
    if failed:
        raise DistributedRunError(f"lightning-fastdist {' '.join(args)} failed:\n" + _failures(failed))
    return outputs


def run_launcher(
    command: Sequence[str], timeout: float = 180.0, cwd: str | Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run one command that starts its own ranks; kill the whole group on timeout.

    Raises :class:`DistributedRunError` with the output on a non-zero exit or a timeout.
    """
    process = subprocess.Popen(
        list(command),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise DistributedRunError(
            f"{' '.join(command)} timed out after {timeout:.0f} s:\n{_tail(stdout + stderr)}"
        ) from None
    if process.returncode != 0:
        raise DistributedRunError(f"{' '.join(command)} exited {process.returncode}:\n{_tail(stdout + stderr)}")
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
