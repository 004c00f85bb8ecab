"""The names the compiler and the runtimes compare: the choices of ``Config`` (mode, backend,
residency planner, activation policy, ZeRO collectives, host optimizer kernel), memory-op kinds, run kinds, phases, moments.

They are ``str`` enums, so a value prints and serialises as its plain name (``"fetch"``) and
compares equal to it, while code that branches on a kind names the enum member.
"""

from __future__ import annotations

import enum


class StrEnum(str, enum.Enum):
    """A str enum whose members print as their value (Python 3.10 has no enum.StrEnum)."""

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


class MemKind(StrEnum):
    """What a memory node (or a residency-plan action) does."""

    FETCH = "fetch"                      # host -> device slot
    WAIT = "wait"                        # an asynchronous fetch must have landed here
    WRITEBACK = "writeback"              # dirty device slot -> host
    DROP = "drop"                        # the slot no longer holds the chunk (no bytes move)
    STORE_GRAD = "store_grad"            # a gradient overwrites its parameter's chunk space
    ACCUMULATE_GRAD = "accumulate_grad"  # a gradient is added into the fp32 host accumulation chunk
    ALLGATHER = "allgather"              # ZeRO: own shard host -> slot, the other shards from their owners
    RELEASE_REMOTE = "release_remote"    # ZeRO: the slot no longer holds the gathered group (no bytes move)
    REDUCE_SCATTER = "reduce_scatter"    # ZeRO: the group's gradients summed over ranks, own shard -> host
    BROADCAST = "broadcast"              # ZeRO per chunk: the owner's chunk host -> its slot -> every rank
    REDUCE = "reduce"                    # ZeRO per chunk: the chunk's gradients summed into its owner's home
    DISK_READ = "disk_read"              # a chunk homed on disk: disk -> a host staging buffer, ahead of its fetch
    UPDATE = "update"                    # a chunk's gradients are final on the host: its AdamW update starts
                                         # on a host thread while the backward goes on (plan_early_updates)
    OFFLOAD = "offload"                  # a saved activation: device -> host, after its last forward use
    RELOAD = "reload"                    # ... and host -> device, before its first backward use
    # (What a kind does to residency, arrives, leaves, reduces, is declared with its op: graph/ops.py.)


class RunKind(StrEnum):
    """Which iteration a schedule runs."""

    TRAIN = "train"    # forward + backward, gradients into the parameter chunks, then the update
    ACCUM = "accum"    # one micro-batch of gradient accumulation (gradients into fp32 host chunks)
    EVAL = "eval"      # forward only

    @property
    def backward(self) -> bool:
        return self is not RunKind.EVAL

    @property
    def keeps_warm(self) -> bool:
        """Runs that update nothing may leave clean chunks resident for the next run."""
        return self is not RunKind.TRAIN


class Phase(StrEnum):
    """Which half of the iteration a node of the captured graph belongs to."""

    FWD = "fwd"        # computes the loss
    BWD = "bwd"        # everything after


class MomentKind(StrEnum):
    """Where in the iteration a moment of hooks mode is."""

    FWD = "fwd"                  # a module's pre-forward hook
    FWD_RELEASE = "fwd_release"  # its post-forward hook
    BWD = "bwd"                  # a backward node first unpacks a saved parameter view
    BWD_END = "bwd_end"          # backward is done
    GRAD = "grad"                # a parameter's gradient was stored
    EVAL_END = "eval_end"        # a forward-only pass is done
    OPT = "opt"                  # one chunk's update


# ------------------------------------------------------------------ the choices of Config
# ``Config`` takes a member or its value ("compiled" or Mode.COMPILED) and holds the member. Where a
# choice is recorded (checkpoint metadata) it is written as ``str(member)``, its plain value, which
# ``torch.load(weights_only=True)`` accepts.
class Mode(StrEnum):
    """How pscompile runs a model."""

    COMPILED = "compiled"    # the whole iteration captured as one FX graph, every move a node in it
    HOOKS = "hooks"          # PatrickStar's runtime design: hooks, a warm-up trace, eviction at run time


class Backend(StrEnum):
    """Compiled mode: what runs the compute between memory nodes."""

    INDUCTOR = "inductor"    # regions compiled by Inductor
    EAGER = "eager"          # regions as the Python code FX generates


class Policy(StrEnum):
    """Compiled mode's residency planner."""

    BELADY = "belady"        # fetch on demand, evict the chunk used farthest ahead
    ANGEL = "angel"          # ANGEL-PTM's unified scheduler (Algorithm 1)


class Activations(StrEnum):
    """Which saved activations leave the device between the forward and the backward."""

    AUTO = "auto"            # the fewest segments that let the schedule fit, each the cheaper way
    KEEP = "keep"
    RECOMPUTE = "recompute"
    OFFLOAD = "offload"


class HostKernel(StrEnum):
    """Which kernel updates the chunks whose optimizer states live on the host."""

    AUTO = "auto"            # a kernel for chunks of at least 1M elements (NATIVE where it builds, else
                             # INDUCTOR), else torch's fused
    NATIVE = "native"        # the C++ pass per chunk (optim/host_adamw.cpp, built once per machine)
    INDUCTOR = "inductor"    # one Inductor-generated pass per chunk (optim/host_kernel.py)
    EAGER = "eager"          # torch._fused_adamw_ (16-bit gradients: upcast, step, cast back per block)


class FrozenFormat(StrEnum):
    """How frozen weights are kept at home and moved (``memory/chunk_kinds.py``)."""

    COMPUTE = "compute"      # the compute dtype
    NF4 = "nf4"              # frozen nn.Linear weights in NF4, bitsandbytes' layout (QLoRA's base)


class Collectives(StrEnum):
    """ZeRO's collectives."""

    GROUP = "group"          # all-gather a group of world_size chunks, reduce-scatter it
    PER_CHUNK = "per_chunk"  # broadcast each chunk from its owner, reduce its gradients to it

