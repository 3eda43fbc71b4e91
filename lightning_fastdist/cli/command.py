"""``main``: the ``lightning-fastdist`` command line, from the arguments to the lines printed after a run.

The help and the extra subcommands (each ``main(argv)`` in ``commands/``) are answered here; ``fit``, ``validate``,
``test`` and ``predict`` have their arguments prepared (``args.py``) and run through ``FastDistCLI`` (``app.py``),
then rank 0 prints the final numbers and where everything went (``report.py``). A ``UsageError`` (``errors.py``)
or a Trainer that does not fit its SLURM allocation ends with exit status 2 and one of the ``EXPLAINED_FAILURES``
or a peer lost in a collective with 1, each as one line on stderr, no traceback.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch.distributed
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch import LightningDataModule, LightningModule

from lightning_fastdist.callbacks.nonfinite_loss import NonFiniteLossError
from lightning_fastdist.cli.app import FastDistCLI
from lightning_fastdist.cli.args import check_ckpt_path, drop_init_args_of_replaced_classes, resolve_config_paths
from lightning_fastdist.cli.config import OwnConfigSaver
from lightning_fastdist.cli.errors import UsageError
from lightning_fastdist.cli.quiet import silence_known_noise
from lightning_fastdist.cli.report import final_numbers, where_things_went
from lightning_fastdist.data import ResumeRefusedError
from lightning_fastdist.diagnostics.slurm_allocation import LaunchMismatchError
from lightning_fastdist.parallel.across_nodes.group import JobEndedError
from lightning_fastdist.parallel.checkpoint.problems import UnusableCheckpointError
from lightning_fastdist.parallel.checkpoint.save_failure import CheckpointSaveError
from lightning_fastdist.parallel.faults.collective_timeout import explained_lost_peer
from lightning_fastdist.parallel.faults.job_identity import JobIdentityError
from lightning_fastdist.strategies.checkpoint.fault_tolerance import NonFiniteCheckpointError
from lightning_fastdist.strategies.common.ray_worker import ray_train_context

PROGRAM = "lightning-fastdist"
# Failures during a run whose one-line message is the whole story (no traceback is printed for them).
EXPLAINED_FAILURES = (
    JobEndedError,
    JobIdentityError,
    UnusableCheckpointError,
    CheckpointSaveError,
    NonFiniteCheckpointError,
    NonFiniteLossError,
    ResumeRefusedError,
)
# Subcommand -> module in lightning_fastdist.commands with main(argv) -> exit status.
EXTRA_COMMANDS = {
    "recipes": "recipes",
    "bench": "bench.command",
    "doctor": "doctor.command",
    "tune": "tune.command",
    "coordinator": "coordinator",
    "to-lightning": "to_lightning",
}
TRAINER_COMMANDS = ("fit", "validate", "test", "predict")
HELP = f"""usage: {PROGRAM} COMMAND [options]

Fast distributed training with PyTorch Lightning: LightningCLI whose model and data default to the
built-in demo workload (lightning_fastdist.demo.TinyGPT on TextDataModule).

commands:
  fit       train. Metrics and the resolved config go to the logger's folder (the recipes:
            lightning_logs/RECIPE/version_N/; without a logger the config goes to the working
            directory, never over a file it did not write), checkpoints to the ModelCheckpoint
            folder (the recipes: checkpoints/RECIPE/).
  validate  evaluate a checkpoint (--ckpt_path) on the validation data; metrics and config as for fit.
  test      the same on the test data.
  predict   run the model on the predict data; metrics and config as for fit.
  recipes   list the packaged recipes (--path NAME prints one's file); writes nothing.
  bench     train one recipe under DDP, FSDP and DeepSpeed setups side by side; writes bench.json,
            bench.png and one log per setup into --output (default bench_results/), nothing else.
  doctor    report the machine, estimate memory per device and write a recipe that fits into
            --output (default doctor-recipe.yaml).
  tune      measure candidate setups of one recipe (pruned by a memory plan, successive halving,
            a loss guard) and write the fastest as a recipe (--output, default tuned.yaml); logs
            and tune.png go to --workdir (default tune_runs/).
  coordinator  serve torchft's lighthouse and the nodes' meeting store outside the nodes, so that a job
            under replica_groups (or outer_sync with min_nodes) survives losing node 0; writes nothing.
  to-lightning  turn a checkpoint of ours (a file, FSDP's sharded folder, DeepSpeed's folder) into the one
            file Lightning's DDPStrategy and ModelParallelStrategy resume (weights, optimizer, loops): OUTPUT.

Run '{PROGRAM} COMMAND --help' for a command's options, e.g. '{PROGRAM} fit --help'.
Try it: '{PROGRAM} fit --config cpu_smoke' trains the demo on 2 CPU processes.
"""


@rank_zero_only
def _say(line: str, stream: Any = None) -> None:
    print(f"{PROGRAM}: {line}", file=stream or sys.stdout, flush=True)


def _close_process_group(wait_for_peers: bool) -> None:
    """Close the process group Lightning leaves open.

    A gloo group alive at interpreter exit can abort the process ("terminate called without an active exception"),
    and so can one rank tearing its connections down while another still uses them: hence the barrier after a run.
    Inside a Ray Train worker the group is Ray's, made before the command ran and closed by Ray: it stays.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()) or ray_train_context():
        return
    if wait_for_peers:
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> None:
    """Run the command line on ``argv`` (``None``: ``sys.argv``, into which the rewritten arguments are written
    back, because Lightning's launcher re-runs ``sys.argv`` on the other ranks)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if os.getcwd() not in sys.path and "" not in sys.path:  # as with ``python -m``, on every launched rank too
        sys.path.insert(0, os.getcwd())
    if not args or args[0] in ("-h", "--help"):
        print(HELP, end="")
        raise SystemExit(0 if args else 2)
    if args[0] in EXTRA_COMMANDS:
        command = importlib.import_module(f"lightning_fastdist.commands.{EXTRA_COMMANDS[args[0]]}")
        raise SystemExit(command.main(args[1:]))
    subcommand = args[0] if args[0] in TRAINER_COMMANDS else ""
    try:
        if not args[0].startswith("-") and not subcommand:
            raise UsageError(
                f"unknown command {args[0]!r}; choose from {', '.join([*TRAINER_COMMANDS, *EXTRA_COMMANDS])}."
            )
        args = resolve_config_paths(args)
        check_ckpt_path(args)
        args, notes = drop_init_args_of_replaced_classes(args)
        for note in notes:
            _say(f"note: {note}", sys.stderr)
        if argv is None:
            sys.argv[1:] = args
        silence_known_noise(resuming=any(arg.partition("=")[0] == "--ckpt_path" for arg in args))
        cli = FastDistCLI(
            LightningModule,
            LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=None if argv is None else args,
            parser_kwargs={"prog": PROGRAM},
            save_config_callback=OwnConfigSaver,
        )
        _close_process_group(wait_for_peers=True)
        if cli.trainer.is_global_zero:
            if subcommand == "fit":
                _say(final_numbers(cli.trainer))
            _say(where_things_went(cli.trainer, fitted=subcommand == "fit"))
    except UsageError as error:
        print(f"{PROGRAM}: error: {error}", file=sys.stderr)
        print(f"Run '{PROGRAM} {subcommand} --help'.".replace("  ", " "), file=sys.stderr)
        raise SystemExit(2) from None
    except LaunchMismatchError as error:
        # A usage mistake found once the launcher's allocation is known (every rank says it, before any collective).
        print(f"{PROGRAM}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except EXPLAINED_FAILURES as error:
        # The message says what happened and what to do; a traceback would bury it.
        print(f"{PROGRAM}: error: {error}", file=sys.stderr)
        raise SystemExit(1) from None
    except Exception as error:
        if explained_lost_peer(error) is None:
            raise
        # A peer lost in a collective: the strategy logged the one line that says so (its cause, what to do); the
        # traceback of the collective that failed would only bury it.
        raise SystemExit(1) from None
    finally:
        _close_process_group(wait_for_peers=False)
