"""A real SLURM cluster on this machine: one ``munged``, one ``slurmctld`` and N ``slurmd`` (nodes ``n0``, ``n1``, ...).

Tests of what the package does under SLURM (preemption, requeue, ``--signal``, a lost node) run their jobs here
instead of faking SLURM's environment variables: the signals, the requeue and the restart count are SLURM's own.

How it is built (each choice checked on this machine with Debian 12's slurm-wlm 22.05.8):

- Everything lives in one state folder of the cluster's own: ``slurm.conf``, the munge key and socket, the
  controller's state, a spool folder per node, the daemons' logs, the job scripts and outputs. Nothing under
  ``/etc`` is read or written: the daemons and every client command find the configuration through ``SLURM_CONF``,
  set in the environment of the processes started here (never in ``os.environ``); ``PlugStackConfig`` names an
  empty file of the folder, so ``/etc/slurm/plugstack.conf`` is not read either.
- munged runs with its own random key and socket; ``AuthInfo=socket=...`` points SLURM at it. munged refuses a
  socket in a folder that not everyone may search, parents included: the default state folder ``/tmp/slurm-XXXX``
  qualifies, pytest's ``tmp_path`` (under a 0700 folder) does not.
- Several slurmd on one host: ``slurmd -N nK``, each node its own ``Port=`` (a free one the OS hands out, as is the
  controller's: two runs on one machine do not collide) and spool folder. ``ProctrackType=proctrack/linuxproc`` and
  ``TaskPlugin=task/none`` need no cgroups; ``SlurmdParameters=config_overrides`` lets a node claim more CPUs than
  the machine has (two nodes of 8 CPUs run on 2 cores).
- Preemption (``PreemptType=preempt/partition_prio``): ``DEFAULT_PARTITIONS`` below. What SLURM 22.05 does there,
  as measured: in a partition without GraceTime a preempted job is requeued at once (SIGCONT + SIGTERM to the batch
  script and to every task, SIGKILL ``kill_wait`` s later). With a GraceTime only the tasks get SIGTERM (the batch
  script nothing), or the job's ``--signal`` instead when ``preempt_send_user_signal`` is set; the job is requeued
  when the grace ends, checked on slurmctld's fixed 30 s timer, so 0-30 s late; and a job that ends by itself
  within the grace is not requeued at all (FAILED or COMPLETED by its own exit status).
- That 30 s timer (``PERIODIC_TIMEOUT``, compiled in) also drives ``--signal=[B:]SIG@N`` (sent at the first tick
  when at most N + 30 s are left: up to 30 s early) and the time limit (the job is ended at the first tick past
  it: up to 30 s late); ticks come every 30 s from slurmctld's start. ``scancel --signal`` is immediate.
- Fast settings: the scheduler runs each second (``sched_interval=1``; a submitted job starts ~1 s later, the
  first after start ~2 s); a requeued job starts again ``requeue_delay`` + 1 s after its run ended (SLURM's
  ``cred_expire``, 120 s by default, 5 at least); finished jobs stay visible to ``scontrol show job`` for an hour
  (``MinJobAge``): there is no accounting database, so ``sacct`` knows nothing.
- Finding a cluster's processes: slurmd double-forks each ``slurmstepd`` (whose parent is then PID 1), and the
  stepd keeps slurmd's environment: so every daemon and stepd of the cluster carries ``SLURM_CONF=<its conf>``, and
  a node's slurmd and stepds also carry ``TEST_SLURMD_NODE=<node>`` (the jobs' tasks do not: their environment is
  the one sbatch sent). ``kill_node`` and ``stop`` SIGKILL the processes that carry those, with their descendants,
  until none is left, so they kill nothing of another cluster or of the machine.

Jobs run as root (the tests are root), on this machine, with the submitting process's environment
(``--export=ALL``, SLURM's default) less any ``SLURM_*``/``SBATCH_*``/``SRUN_*``/``SALLOC_*`` variable of an outer
allocation, plus ``SLURM_CONF`` and what ``submit(env=...)`` adds. The cluster starts in about 1 s and stops in
about 0.2 s.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

#: States after which a job does not run again (unless someone requeues it).
FINISHED_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY"}
)
_NODE_VARIABLE = "TEST_SLURMD_NODE"
_POLL_S = 0.1
# Variables of an outer allocation (the tests themselves running under SLURM) that sbatch and srun would read.
_OUTER_SLURM_VARIABLE = re.compile(r"^(SLURM|SBATCH|SRUN|SALLOC)_")
# One `key=value` of `scontrol show job -o`; a value may hold spaces (Command=, Comment=) but not ` word=`.
_SCONTROL_FIELD = re.compile(r"(\S+?)=(.*?)(?= \S+?=|$)")


class SlurmError(RuntimeError):
    """A SLURM daemon did not come up, or a command failed; the message holds its output or the log's tail."""


def slurm_available() -> str | None:
    """Why a SLURM cluster cannot be built here (one line), or None when it can."""
    if os.geteuid() != 0:
        return "the SLURM cluster needs root (its daemons run as root)"
    missing = [name for name in ("munged", "slurmctld", "slurmd", "sbatch", "scontrol") if shutil.which(name) is None]
    if missing:
        return f"SLURM is not installed ({', '.join(missing)} not found; apt-get install slurm-wlm munge)"
    return None


@dataclass(frozen=True)
class Partition:
    """One partition over all the nodes.

    ``priority_tier``: with ``preempt/partition_prio`` a job of a higher tier preempts jobs of a lower one.
    ``preempt_mode``: what happens to this partition's jobs when preempted (``REQUEUE``, ``CANCEL``, ``OFF``).
    ``grace_time``: seconds from the preempted job's first signal to its requeue (see the module's notes).
    """

    name: str
    priority_tier: int = 1
    preempt_mode: str = "REQUEUE"
    grace_time: int = 0
    default: bool = False


#: ``low`` (the default partition): a ``high`` job requeues its jobs at once. ``low_grace``: a ``high`` job
#: signals its jobs' tasks, and requeues the jobs 5-35 s later. ``high``: never preempted.
DEFAULT_PARTITIONS = (
    Partition("low", priority_tier=1, preempt_mode="REQUEUE", default=True),
    Partition("low_grace", priority_tier=1, preempt_mode="REQUEUE", grace_time=5),
    Partition("high", priority_tier=2, preempt_mode="OFF"),
)


@dataclass(frozen=True)
class Job:
    """What ``scontrol show job`` says about a job at one moment.

    ``state``: ``PENDING``, ``RUNNING``, ``COMPLETING``, ``COMPLETED``, ``CANCELLED``, ... ``exit_code`` and
    ``signal``: the batch script's, SLURM's ``ExitCode=code:signal``. ``restarts``: how often it was requeued (its
    next run sees it as ``SLURM_RESTART_COUNT``). ``fields``: every field as printed.
    """

    job_id: int
    state: str
    reason: str
    exit_code: int
    signal: int
    restarts: int
    nodes: str
    stdout: Path | None
    stderr: Path | None
    fields: Mapping[str, str] = field(repr=False)

    @classmethod
    def parse(cls, line: str) -> Job:
        """Read one line of ``scontrol --oneliner show job``."""
        fields = {match.group(1): match.group(2) for match in _SCONTROL_FIELD.finditer(line.strip())}
        exit_code, _, exit_signal = fields.get("ExitCode", "0:0").partition(":")
        return cls(
            job_id=int(fields["JobId"]),
            state=fields["JobState"],
            reason=fields.get("Reason", "None"),
            exit_code=int(exit_code),
            signal=int(exit_signal or 0),
            restarts=int(fields.get("Restarts", "0")),
            nodes=fields.get("NodeList", "(null)"),
            stdout=Path(fields["StdOut"]) if fields.get("StdOut") else None,
            stderr=Path(fields["StdErr"]) if fields.get("StdErr") else None,
            fields=fields,
        )


def _free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _stat_fields(pid: int) -> list[str]:
    """``/proc/PID/stat`` after the command name: state, parent, ... (raises OSError once the process is gone)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (its parent, often PID 1, may reap it later)."""
    try:
        return _stat_fields(pid)[0] != "Z"
    except OSError:
        return False


def _with_descendants(roots: Iterable[int]) -> list[int]:
    """``roots`` and all their descendants, parents before children."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            children.setdefault(int(_stat_fields(int(stat.parent.name))[1]), []).append(int(stat.parent.name))
        except OSError:  # ended while we looked
            continue
    found, queue = [], list(roots)
    while queue:
        pid = queue.pop(0)
        found.append(pid)
        queue.extend(children.get(pid, []))
    return found


def _processes_with_environment(entries: Iterable[str]) -> list[int]:
    """The live processes (this one aside) whose environment holds every one of ``entries`` (``NAME=value``)."""
    wanted = {entry.encode() for entry in entries}
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        pid = int(environ.parent.name)
        try:
            held = set(environ.read_bytes().split(b"\0"))
        except OSError:  # ended while we looked
            continue
        if wanted <= held and pid != os.getpid() and _running(pid):
            found.append(pid)
    return found


def _kill_and_wait(pids: Sequence[int], timeout: float = 10.0) -> None:
    """SIGKILL ``pids`` and wait until they are gone: a killed process takes a moment to exit."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.01)


def _kill_every_process_with(entries: Sequence[str]) -> None:
    """SIGKILL every process whose environment holds ``entries``, and their descendants, until none is left: one
    that forks as we look (a slurmd starting a slurmstepd) leaves its child to the next pass."""
    for _ in range(20):
        marked = _processes_with_environment(entries)
        if not marked:
            return
        _kill_and_wait(_with_descendants(marked))
    raise SlurmError(f"processes with {entries} in their environment outlive SIGKILL: {marked}")


class SlurmCluster:
    """A SLURM cluster of ``nodes`` nodes on this machine, for the duration of a ``with`` block.

    ``state_dir``: a folder that does not exist yet, created on start and removed on stop, whose parents everyone
    may search (munged's rule); by default a new ``/tmp/slurm-XXXX``. ``cpus_per_node``: what each node offers
    (more than the machine has is allowed). ``kill_wait``: seconds from SIGTERM to SIGKILL when a job is cancelled,
    requeued, preempted or out of time (SLURM's ``KillWait``). ``requeue_delay``: seconds a requeued job waits
    before it may start again, 5 at least (SLURM's ``cred_expire``, also how late a step launch may arrive).
    ``slurmd_timeout``: how long a silent slurmd goes before its node is DOWN. ``preempt_send_user_signal``: a
    preempted job in a partition with a GraceTime gets its ``--signal`` instead of SIGTERM.
    """

    def __init__(
        self,
        state_dir: Path | None = None,
        *,
        nodes: int = 2,
        cpus_per_node: int = 1,
        partitions: Sequence[Partition] = DEFAULT_PARTITIONS,
        kill_wait: int = 10,
        requeue_delay: int = 5,
        slurmd_timeout: int = 30,
        preempt_send_user_signal: bool = True,
        ready_timeout: float = 60.0,
    ) -> None:
        self.requested_dir = state_dir
        self.nodes = [f"n{index}" for index in range(nodes)]
        self.cpus_per_node = cpus_per_node
        self.partitions = tuple(partitions)
        self.kill_wait = kill_wait
        self.requeue_delay = requeue_delay
        self.slurmd_timeout = slurmd_timeout
        self.preempt_send_user_signal = preempt_send_user_signal
        self.ready_timeout = ready_timeout
        self._root: Path | None = None
        self._daemons: dict[str, subprocess.Popen[bytes]] = {}

    # ----- life cycle -------------------------------------------------------------------------------------------

    def __enter__(self) -> SlurmCluster:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> None:
        """Write the configuration, start munged, slurmctld and every slurmd, and wait until all nodes are idle."""
        if self.requested_dir is None:
            self._root = Path(tempfile.mkdtemp(prefix="slurm-", dir="/tmp"))
        else:
            Path(self.requested_dir).mkdir(parents=True)  # a folder that exists is refused, so stop() removes ours
            self._root = Path(self.requested_dir)
        try:
            self._lay_out()
            self._start_munged()
            self._start_daemon("slurmctld", ["slurmctld", "-D"])
            for node in self.nodes:
                self.start_node(node)
            self.wait_nodes("idle", timeout=self.ready_timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Kill every process of the cluster (daemons, job steps, their tasks) and remove its state folder.

        SIGKILL, not a graceful stop: what the daemons would save goes with the folder."""
        if self._root is None:
            return
        _kill_every_process_with([f"SLURM_CONF={self.conf}"])
        for process in self._daemons.values():
            process.wait()  # reap them: they are dead
        self._daemons.clear()
        shutil.rmtree(self._root, ignore_errors=True)
        self._root = None

    @property
    def root(self) -> Path:
        """The state folder (between ``start`` and ``stop``)."""
        if self._root is None:
            raise SlurmError("the cluster is not started")
        return self._root

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def jobs_dir(self) -> Path:
        """Where ``submit`` writes job scripts and, unless told otherwise, the jobs' output (``<job id>.out``)."""
        return self.root / "jobs"

    @property
    def env(self) -> dict[str, str]:
        """The environment for a SLURM command of this cluster: this process's, less an outer allocation's
        variables, plus ``SLURM_CONF``."""
        env = {name: value for name, value in os.environ.items() if not _OUTER_SLURM_VARIABLE.match(name)}
        env["SLURM_CONF"] = str(self.conf)
        return env

    # ----- configuration ----------------------------------------------------------------------------------------

    def _lay_out(self) -> None:
        root = self.root
        root.chmod(0o755)
        blocked = [str(folder) for folder in [root, *root.parents] if not folder.stat().st_mode & 0o001]
        if blocked:
            raise SlurmError(
                f"munged needs every folder above its socket searchable by all, and these are not: {blocked}"
            )
        for sub in ("munge", "ctld", "log", "jobs", *(f"spool/{node}" for node in self.nodes)):
            (root / sub).mkdir(parents=True, exist_ok=True)
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        (root / "plugstack.conf").write_text("")
        self.conf.write_text(self._slurm_conf())

    def _slurm_conf(self) -> str:
        root = self.root
        host = socket.gethostname().split(".")[0]  # slurmctld runs only on the host that SlurmctldHost names
        lines = [
            "ClusterName=fastdist",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={root}/munge/munge.socket,cred_expire={self.requeue_delay}",
            f"StateSaveLocation={root}/ctld",
            f"SlurmdSpoolDir={root}/spool/%n",
            f"SlurmctldPidFile={root}/ctld/slurmctld.pid",
            f"SlurmdPidFile={root}/spool/%n/slurmd.pid",
            f"SlurmctldLogFile={root}/log/slurmctld.log",
            f"SlurmdLogFile={root}/log/slurmd-%n.log",
            f"PlugStackConfig={root}/plugstack.conf",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SlurmdParameters=config_overrides",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SchedulerType=sched/builtin",
            "SchedulerParameters=sched_interval=1",
            "PreemptType=preempt/partition_prio",
            "PreemptMode=REQUEUE",
            # A node DOWN for not responding returns when its slurmd registers; one set DOWN by hand needs RESUME.
            "ReturnToService=1",
            "JobRequeue=1",
            f"KillWait={self.kill_wait}",
            f"SlurmdTimeout={self.slurmd_timeout}",
            "MinJobAge=3600",
        ]
        if self.preempt_send_user_signal:
            lines.append("SlurmctldParameters=preempt_send_user_signal")
        for node in self.nodes:
            lines.append(
                f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={_free_port()}"
                f" CPUs={self.cpus_per_node} State=UNKNOWN"
            )
        nodes = ",".join(self.nodes)
        for part in self.partitions:
            lines.append(
                f"PartitionName={part.name} Nodes={nodes} Default={'YES' if part.default else 'NO'} MaxTime=INFINITE"
                f" State=UP PriorityTier={part.priority_tier} PreemptMode={part.preempt_mode}"
                f" GraceTime={part.grace_time}"
            )
        return "\n".join(lines) + "\n"

    # ----- daemons and nodes ------------------------------------------------------------------------------------

    def _start_munged(self) -> None:
        munge = self.root / "munge"
        self._start_daemon(
            "munged",
            [
                "munged",
                "--foreground",
                f"--socket={munge}/munge.socket",
                f"--key-file={munge}/munge.key",
                f"--pid-file={munge}/munged.pid",
                f"--seed-file={munge}/munged.seed",
            ],
        )
        self._wait_for(lambda: (munge / "munge.socket").exists(), "munged's socket", timeout=10)

    def _start_daemon(self, name: str, command: list[str], env: Mapping[str, str] | None = None) -> None:
        """Start one daemon in the foreground; its stderr (errors before its log file opens) goes to log/NAME.err."""
        with open(self.root / "log" / f"{name}.err", "wb") as err:
            self._daemons[name] = subprocess.Popen(
                command, env={**self.env, **(env or {})}, stdin=subprocess.DEVNULL, stdout=err, stderr=subprocess.STDOUT
            )

    def start_node(self, node: str) -> None:
        """Start the node's slurmd (again, after ``kill_node``). A node that went DOWN for not responding comes back
        once it registers; one set DOWN by ``set_node_state`` needs ``set_node_state(node, "RESUME")``."""
        self._start_daemon(f"slurmd-{node}", ["slurmd", "-D", "-N", node], env={_NODE_VARIABLE: node})

    def kill_node(self, node: str) -> None:
        """Kill the node as a power cut would: SIGKILL its slurmd, its slurmstepds and their tasks.

        SLURM notices on its own only when pings have failed for ``slurmd_timeout`` (measured: 47 s after the kill
        with 30, 27 s with 10); then the node is DOWN and its jobs are requeued (NODE_FAIL with ``--no-requeue``).
        ``set_node_state(node, "DOWN")`` right after makes that immediate, as a cluster's health check would."""
        _kill_every_process_with([f"SLURM_CONF={self.conf}", f"{_NODE_VARIABLE}={node}"])
        self._daemons.pop(f"slurmd-{node}").wait()

    def revive_node(self, node: str, *, timeout: float = 60.0) -> None:
        """Bring the node back to ``idle`` whatever happened to it: its slurmd started again if it is not running,
        ``RESUME`` if it is DOWN or drained; then wait until it is idle (its jobs finished)."""
        daemon = self._daemons.get(f"slurmd-{node}")
        if daemon is None or daemon.poll() is not None:
            self._daemons.pop(f"slurmd-{node}", None)
            self.start_node(node)
        if self.node_states().get(node, "").rstrip("*~#") in ("down", "drain", "drng", "fail"):
            self.set_node_state(node, "RESUME")
        self.wait_nodes("idle", [node], timeout=timeout)

    def set_node_state(self, node: str, state: str, reason: str = "set by a test") -> None:
        """``scontrol update NodeName=node State=state``: ``DOWN``, ``DRAIN``, ``RESUME``, ...

        DOWN requeues the jobs running there at once (or ends them NODE_FAIL with ``--no-requeue``). After RESUME
        the node reads ``idle*`` until slurmctld has pinged it (about 1 s): ``wait_nodes("idle")`` waits for that."""
        args = ["scontrol", "update", f"NodeName={node}", f"State={state}"]
        if state.upper() in ("DOWN", "DRAIN", "FAIL"):
            args.append(f"Reason={reason}")
        self.command(*args)

    def node_states(self) -> dict[str, str]:
        """Each node's state as ``sinfo`` prints it (``idle``, ``alloc``, ``down*``, ``drain``, ...)."""
        states = {}
        for line in self.command("sinfo", "--noheader", "--Node", "--format=%N %t", check=False).splitlines():
            node, _, state = line.partition(" ")
            states[node] = state
        return states

    def wait_nodes(self, state: str, nodes: Sequence[str] | None = None, *, timeout: float = 30.0) -> None:
        """Wait until every node of ``nodes`` (all by default) is in ``state`` as ``sinfo`` prints it."""
        wanted = list(nodes or self.nodes)
        self._wait_for(
            lambda: all(self.node_states().get(node) == state for node in wanted),
            f"nodes {','.join(wanted)} {state}",
            timeout=timeout,
        )

    def _wait_for(self, ready: Callable[[], bool], what: str, *, timeout: float) -> None:
        """Poll ``ready``; fail early, with its log's tail, when a daemon of ours has exited."""
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [name for name, process in self._daemons.items() if process.poll() is not None]
            if dead:
                raise SlurmError(f"{', '.join(dead)} exited while waiting for {what}:\n{self._log_tails(dead)}")
            if time.monotonic() > deadline:
                raise SlurmError(f"no {what} after {timeout:.0f} s:\n{self._log_tails(self._daemons)}")
            time.sleep(_POLL_S)

    def _log_tails(self, daemons: Iterable[str]) -> str:
        """The last lines of the daemons' logs and stderr, for an error message."""
        tails = []
        for daemon in daemons:
            for log in sorted((self.root / "log").glob(f"{daemon}.*")):
                lines = log.read_text(errors="replace").splitlines()[-15:]
                tails.append(f"--- {log.name}:\n" + "\n".join(lines))
        return "\n".join(tails)

    # ----- commands and jobs ------------------------------------------------------------------------------------

    def command(self, *args: str, env: Mapping[str, str] | None = None, check: bool = True) -> str:
        """Run a SLURM command (``sinfo``, ``squeue``, ``scontrol``, ...) against this cluster; return its stdout."""
        result = subprocess.run(args, env={**self.env, **(env or {})}, capture_output=True, text=True)
        if check and result.returncode != 0:
            raise SlurmError(f"`{' '.join(args)}` exited {result.returncode}: {result.stderr.strip()}")
        return result.stdout

    def submit(
        self,
        script: str | Path,
        *sbatch_args: str,
        script_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> int:
        """Submit a batch job; return its id.

        ``script``: a path, or the script's text (written to ``jobs/``). ``sbatch_args`` come after the defaults
        (``--output`` and ``--error`` to ``jobs/<job id>.out``) and, like any sbatch option on the command line,
        override the script's ``#SBATCH`` lines. ``script_args``: the script's own arguments (after its name).
        ``env``: variables added to the job's environment. ``cwd``: the job's working folder (``jobs/`` by default).
        """
        if isinstance(script, str):
            fd, name = tempfile.mkstemp(dir=self.jobs_dir, prefix="script-", suffix=".sh")
            with os.fdopen(fd, "w") as file:
                file.write(script)
            script = Path(name)
        output = self.jobs_dir / "%j.out"
        args = ["sbatch", "--parsable", f"--output={output}", f"--error={output}", *sbatch_args, str(script)]
        args += script_args
        result = subprocess.run(
            args, env={**self.env, **(env or {})}, cwd=cwd or self.jobs_dir, capture_output=True, text=True
        )
        if result.returncode != 0:
            raise SlurmError(f"`{' '.join(args)}` exited {result.returncode}: {result.stderr.strip()}")
        return int(result.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> Job:
        """What SLURM says about the job now."""
        return Job.parse(self.command("scontrol", "--oneliner", "show", "job", str(job_id)))

    def job_state(self, job_id: int) -> str:
        """The job's state now (``PENDING``, ``RUNNING``, ``COMPLETED``, ...)."""
        return self.job(job_id).state

    def wait(
        self, job_id: int, states: Iterable[str] = FINISHED_STATES, *, restarts: int = 0, timeout: float = 60.0
    ) -> Job:
        """Wait until the job is in one of ``states`` after at least ``restarts`` requeues; return it then.

        Polls ``scontrol`` every 0.1 s: a state shorter than that may be missed, so wait for a final state, or
        have the job write a file and wait for that."""
        wanted = frozenset(states)
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if job.state in wanted and job.restarts >= restarts:
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"job {job_id} is {job.state} ({job.reason}, {job.restarts} restarts) after {timeout:.0f} s,"
                    f" not {'/'.join(sorted(wanted))} after {restarts} restarts"
                )
            time.sleep(_POLL_S)

    def output(self, job_id: int, stream: str = "stdout") -> str:
        """The text of the job's ``stdout`` or ``stderr`` file so far ("" before it exists).

        A requeued job's run truncates the file unless the job was submitted with ``--open-mode=append``."""
        job = self.job(job_id)
        path = job.stdout if stream == "stdout" else job.stderr
        if path is None or not path.exists():
            return ""
        return path.read_text(errors="replace")

    def requeue(self, job_id: int, *, hold: bool = False) -> None:
        """``scontrol requeue``: end the job's run (SIGCONT + SIGTERM to the batch script and the tasks, SIGKILL
        ``kill_wait`` s later) and queue it again; with ``hold``, it then waits for ``scontrol release``.
        SLURM refuses a job submitted with ``--no-requeue``."""
        self.command("scontrol", "requeuehold" if hold else "requeue", str(job_id))

    def scancel(self, job_id: int, signal: str | None = None, *, batch: bool = False, full: bool = False) -> None:
        """``scancel``: without ``signal``, cancel the job (SIGCONT + SIGTERM to the batch script and the tasks,
        SIGKILL ``kill_wait`` s later); with it (``"USR1"``, ``"TERM"``, ...) only send it: to the tasks of the
        job's steps, not the batch script; with ``batch``, to the batch script only; with ``full``, to both."""
        args = ["scancel"]
        if signal is not None:
            args.append(f"--signal={signal}")
        if batch:
            args.append("--batch")
        if full:
            args.append("--full")
        self.command(*args, str(job_id))
