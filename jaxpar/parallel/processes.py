"""Processes meet before a program's first collectives, at the coordination service, not over gloo.

Why: on an emulated multi-process CPU mesh the processes talk over gloo, and gloo connects each new
group of devices the first time a program runs a collective over it: a process that arrives there
more than 30 seconds after its peers finds them gone ("Gloo context initialization failed:
DEADLINE_EXCEEDED: GetKeyValue() timed out", a limit neither jax nor XLA lets us raise). Once a group
is connected, a peer may be late by minutes (tested: 40 s). Processes drift apart by more than that
wherever they do host work of different lengths: each compiles the step itself, and on CI's two
loaded cores one process finished compiling a 2-process pipeline step over 30 s before the other.
`jax.experimental.multihost_utils.sync_global_devices` is itself a gloo collective, and so is
orbax's default barrier. So before the first call of a program that may connect new groups (the
train step, the evaluation step), and before the first collective of a run, every process waits at
the distributed runtime's own barrier (`meet`), whose timeout is ours; orbax is switched to that
barrier too (its `experimental_orbax_use_distributed_barrier`). GPU runs (NCCL) keep orbax's default;
`meet` costs them one round trip to the coordinator.
"""

from __future__ import annotations

import itertools

import jax

MEET_TIMEOUT_S = 1800  # a late peer is still compiling or loading: wait as long as the watchdog would
_meetings = itertools.count()


def meet(why: str, timeout_s: int = MEET_TIMEOUT_S) -> None:
    """Every process of the run waits here until all have arrived (no-op with one process).

    Call it at the same points in the same order on every process; `why` names the point in the error
    a timeout raises."""
    if jax.process_count() == 1:
        return
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:  # several processes without the distributed runtime: nothing to meet at
        return
    client.wait_at_barrier(f"jaxpar:{next(_meetings)}:{why}", timeout_s * 1000)


def barriers_outside_gloo() -> None:
    """Make orbax's cross-process barriers wait at the distributed runtime, not in a gloo collective
    (see the module docstring); only on CPU processes, where gloo carries the collectives."""
    if jax.process_count() == 1 or jax.devices()[0].platform != "cpu":
        return
    from absl import flags
    from orbax.checkpoint._src.multihost import multihost as orbax_multihost

    flags.FLAGS[orbax_multihost.EXPERIMENTAL_ORBAX_USE_DISTRIBUTED_BARRIER.name].value = True
    if not flags.FLAGS.is_parsed():  # jaxpar's CLI is not absl's: its flags are read as parsed defaults
        flags.FLAGS.mark_as_parsed()


class CompiledTogether:
    """A jitted function compiled at its first call, after which the processes `meet` before it runs.

    Each process compiles for itself, at its own speed; the meeting keeps a slow compile from making
    the program's first collectives wait for a peer longer than gloo does. Later calls run the compiled
    program (same shapes, as the evaluation's batches are)."""

    def __init__(self, jitted, why: str):
        self.jitted, self.why, self.compiled = jitted, why, None

    def __call__(self, *args):
        if self.compiled is None:
            self.compiled = self.jitted.lower(*args).compile()
            meet(self.why)
        return self.compiled(*args)
