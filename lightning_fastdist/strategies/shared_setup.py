"""What every strategy of this package sets up alike, written once: the collective ``timeout``,
the :class:`~lightning_fastdist.parallel.plan.parallel_plan.ParallelPlan` (blocks, activation checkpointing,
compile) and its recompile watcher, the launch (class names checked against the model before any
process starts, the run id in the launch's environment only), a one-file checkpoint published
atomically, and registration under ``strategy_name``.

A strategy lists :class:`SharedSetup` among its mixins (before Lightning's class), calls
:meth:`~SharedSetup.take_shared_options` in ``__init__`` before Lightning's ``__init__`` (which
takes the returned timeout), applies ``self.plan`` where Lightning hands it the model (keeping
what it returns in ``self.prepared``), calls :meth:`~SharedSetup.start_shared` first in ``setup``
and :meth:`~SharedSetup.stop_shared` in ``teardown``, and sets ``strategy_name`` and
``strategy_description``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_fastdist.diagnostics.recompiles import RecompileWatcher
from lightning_fastdist.parallel.checkpoint.atomic import check_save_target, save_file_atomically
from lightning_fastdist.parallel.faults.collective_timeout import collective_timeout
from lightning_fastdist.parallel.plan.blocks import resolve_blocks
from lightning_fastdist.parallel.plan.parallel_plan import ParallelPlan, PreparedBlocks


class SharedSetup:
    """Mixin for the options and the lifecycle that every strategy of this package shares.

    The strategy provides ``start_fault_handling`` (:class:`~lightning_fastdist.strategies.fault_tolerance.
    FaultTolerance`), ``checkpoint_io`` and ``is_global_zero`` (Lightning).
    """

    strategy_name: str
    strategy_description: str

    def take_shared_options(self, timeout: float | timedelta | None, plan: ParallelPlan) -> timedelta:
        """Check and keep ``timeout``, keep ``plan`` (checked when built); return the timeout for Lightning."""
        self.timeout = collective_timeout(timeout, type(self).__name__)
        self.plan = plan
        self.prepared = None
        self.recompiles = RecompileWatcher(report=rank_zero_warn)
        return self.timeout

    @property
    def prepared(self) -> PreparedBlocks | None:
        """What the plan did to the model's blocks (``None`` until it is applied)."""
        return self._prepared

    @prepared.setter
    def prepared(self, prepared: PreparedBlocks | None) -> None:
        self._prepared = prepared
        if prepared is not None:  # a recompile's report names the places a compiled block class runs at
            self.recompiles.call_sites = prepared.compiled_call_sites

    @property
    def checkpointed_blocks(self) -> tuple[Any, ...]:
        """The blocks under activation checkpointing (empty until the plan is applied)."""
        return self.prepared.checkpointed if self.prepared is not None else ()

    @property
    def compiled_regions(self) -> tuple[Any, ...]:
        """The modules whose ``forward`` is compiled (empty until the plan is applied)."""
        return self.prepared.compiled if self.prepared is not None else ()

    def _configure_launcher(self) -> None:
        super()._configure_launcher()  # type: ignore[misc]
        launcher = self._launcher  # type: ignore[attr-defined]
        if launcher is not None:  # an instance attribute: the launcher's class (and isinstance checks) stay Lightning's
            launcher.launch = functools.partial(_checked_launch, self, launcher.launch)

    def check_names(self, module: Any) -> None:
        """Raise the one-line ``ValueError`` of a class name in the options that ``module`` lacks (a misspelt
        block), before any process starts; a model that builds its layers in ``configure_model`` is checked
        later, when the plan is applied."""
        if module is not None and not is_overridden("configure_model", module):
            self.resolve_names(module)

    def resolve_names(self, module: Any) -> None:
        """Resolve every class name of the options in ``module`` (a strategy with more names extends it)."""
        resolve_blocks(module, self.plan.blocks)

    def start_shared(self, trainer: Any) -> None:
        """Job identity and preemption handling, and the recompile watcher when compiling."""
        self.start_fault_handling(trainer)  # type: ignore[attr-defined]
        if self.plan.compile_config is not None:
            self.recompiles.start()

    def stop_shared(self) -> None:
        self.recompiles.stop()

    def save_one_file(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Rank 0 writes ``checkpoint`` as one file under ``<name>.partial``, renamed onto ``<name>`` once complete.

        Every rank first refuses a folder at ``filepath`` that is not a checkpoint, so all ranks stop alike.
        """
        check_save_target(Path(filepath), sharded=False)
        if self.is_global_zero:  # type: ignore[attr-defined]
            save_file_atomically(
                lambda staged: self.checkpoint_io.save_checkpoint(checkpoint, staged, storage_options),  # type: ignore[attr-defined]
                Path(filepath),
            )

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description=cls.strategy_description)

    @classmethod
    def register_once(cls) -> None:
        """Register in Lightning's registry unless a first import already did."""
        if cls.strategy_name not in StrategyRegistry:
            cls.register_strategies(StrategyRegistry)


def _checked_launch(
    strategy: Any, launch: Callable[..., Any], function: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    """Lightning's ``launch``, after the options' class names were checked against the model (raised once, in
    this process, before another starts) and with the launch's run id in the environment of the launch only."""
    strategy.check_names(strategy.lightning_module)
    with strategy.launch_identity():
        return launch(function, *args, **kwargs)
