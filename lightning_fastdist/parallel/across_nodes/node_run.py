"""What a process that talks across nodes holds for one fit, under either form: torchft's ``Manager`` (a node that
heals receives a live node's state over a transport whose bytes are counted), who each quorum holds, and the register
where the nodes meet. Each form builds its own parts on top (``outer_sync/run.py``, ``replica_groups/run.py``). One
private torchft name is read (``torchft_names.py``): the manager's pending quorum, which a restarted node waits for.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import wait
from datetime import timedelta
from typing import Any

from torch import nn

from lightning_fastdist.parallel.across_nodes.group import (
    REJOIN_POLL_S,
    FitRegister,
    JobEndedError,
    Membership,
    ReplicaGroup,
    equalize_weights,
)
from lightning_fastdist.parallel.across_nodes.rejoin import NODE_STATE_KEY, NodeState, Rejoined
from lightning_fastdist.parallel.across_nodes.state_transport import NodeStateTransport
from lightning_fastdist.parallel.across_nodes.torchft_servers import new_manager


class NodeRun:
    """torchft's ``Manager`` of this process's replica group for one fit.

    Args:
        option: the form's option, as its lines name it (``"outer_sync"``).
        meeting: where a node that heartbeats but does not come in time was expected (``"the sync"``).
        async_quorum: a quorum overlaps the step's compute (a node that heals sits that step out).
        report: called with the lines saying which nodes left or came back.

    Attributes:
        steps: optimizer steps of this fit.
        rejoined: how this node joined the running job, where it did.
    """

    def __init__(
        self,
        group: ReplicaGroup,
        timeout: timedelta,
        option: str,
        meeting: str,
        async_quorum: bool,
        report: Callable[[str], object] | None,
    ) -> None:
        self.group = group
        self.option = option
        self._transport = NodeStateTransport(group.store_host, group.transport_token, timeout)
        self.manager = new_manager(group, timeout, self._transport, async_quorum, owner=option)
        self.steps = 0
        self.rejoined: Rejoined | None = None
        self.membership = Membership(option, group.num_nodes, lambda: self.steps, meeting, report)
        self.membership.watch(self.manager)
        self._register = FitRegister(group, timeout)

    @property
    def joining(self) -> bool:
        """Whether this node started while the others train: it rejoins them instead of starting with them."""
        return self._register.joining

    def wait_to_be_taken_back(self) -> None:
        """Wait for the quorum that takes this restarted node back (after ``start_quorum``). The nodes may end the job
        meanwhile (it took its last steps when this node read the register): no quorum would then form before
        torchft's timeout, so the register is read every ``REJOIN_POLL_S`` and the job's end is said at once.

        Raises:
            JobEndedError: the register no longer says that the nodes train.
        """
        taken_back = self.manager._quorum_future
        while not wait([taken_back], timeout=REJOIN_POLL_S).done:
            if not self._register.still_training():
                raise JobEndedError(
                    f"{self.option}: node{self.group.node_rank} was started again as the job took its last steps, and "
                    "the job ended before a quorum took this node back: nothing was trained here; the job's "
                    "checkpoints are those its other nodes wrote."
                )
        taken_back.result()  # raises what the quorum raised

    def start_with_equal_weights(self, model: nn.Module, timeout: timedelta) -> None:
        """Give every node the first node's weights, then say in the register that the nodes train."""
        equalize_weights(self.manager, model, self.option, self.membership, timeout)
        self._register.training_started()

    def serve_state(self, node_state: NodeState) -> None:
        """Let torchft send ``node_state`` to a node that heals, and receive one where this node does."""
        self.manager.register_state_dict_fn(NODE_STATE_KEY, node_state.receive, node_state.snapshot)

    def rejoined_with(self, received: dict[str, Any]) -> Rejoined:
        """How this node rejoined, from the ``received`` state of a live node (``NodeState.snapshot``'s)."""
        return Rejoined(
            source=self.membership.recovery_source or "?",
            step=self.steps,
            received_bytes=self._transport.received_bytes,
            position=received["position"],
            inner_optimizer=received["optimizer"],
        )

    def close(self) -> None:
        """Stop this process's torchft servers and mark the nodes as no longer training in the register, so that a
        node that starts now starts a fit of its own."""
        self.manager.shutdown(wait=False)
        self._register.close(self.membership.quorum_nodes)
