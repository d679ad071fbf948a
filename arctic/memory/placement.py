"""Where a rank's sharded training state lives: on the device, or offloaded to the host.

The planner traces FSDP2 with everything on the device: fp32 parameter shards, fp32 gradient
shards and AdamW's two fp32 moments, 16 bytes per parameter of the rank's shard. Offloading
moves some of them to the host, and a trace on one CPU cannot tell the two apart (the fake
tensors all live on "cpu"), so the planner traces on the device and moves the bytes here:
:class:`Placement` says, per parameter of the shard, how many bytes stay on the device and how
many the host holds, and :func:`placement_from_ds_config` reads them from a DeepSpeed config.

With ``p`` the bytes of the dtype DeepSpeed trains in (2 for bf16 or fp16, 4 for fp32) and
``g`` those of its gradient accumulation dtype (``data_types.grad_accum_dtype``, by default
the training dtype), for bf16 (p = g = 2):

    mode              device B/param  host B/param     what
    none              16              0                FSDP2 or ZeRO-3, nothing offloaded
    optimizer         p (2)           16 + g (18)      ZeRO-3 offload_optimizer: the p-byte
                                                       partition stays on the device; the host
                                                       has the fp32 master (4) and its fp32
                                                       gradient (4), AdamW's moments (8), and
                                                       the g-byte partition that accumulates
                                                       the reduce-scattered gradients
    optimizer+params  0               16 + g + p (20)  ZeRO-3 offload_optimizer + offload_param:
                                                       the p-byte partition on the host too
    fsdp2             0               16               FSDP2 CPUOffloadPolicy: fp32 params,
                                                       grads and the moments on the host

ZeRO-3 also keeps its gradient bucket on the device (``reduce_bucket_size`` elements of the
communication dtype, when ``contiguous_gradients`` is on, as by default):
:attr:`Placement.device_fixed`. Not modelled: parameters below
``stage3_param_persistence_threshold`` elements (100K by default: the norms, biases) stay
gathered on the device, a few hundred KiB for a Llama-8B. ``tests/test_arctic_plan_offload.py``
checks these figures against a real DeepSpeed (0.19.8) ZeRO-3 step on two gloo ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from offload import activations

MODES = ("none", "optimizer", "optimizer+params", "fsdp2")

DS_REDUCE_BUCKET_SIZE = 500_000_000
"""DeepSpeed's default ``zero_optimization.reduce_bucket_size`` (elements)."""

# DeepSpeed's names of a dtype (its DtypeEnum and communication_data_type), in bytes.
_DTYPE_BYTES = {"fp32": 4, "float32": 4, "torch.float32": 4, "float": 4, "fp16": 2,
                "float16": 2, "torch.float16": 2, "half": 2, "bf16": 2, "bfloat16": 2,
                "torch.bfloat16": 2}


@dataclass(frozen=True)
class Placement:
    """Bytes per parameter of a rank's shard on the device and on the host, and the fixed
    device bytes the offload adds (ZeRO-3's gradient bucket)."""

    mode: str = "none"
    device_fixed: int = 0
    param_bytes: int = 2
    """Bytes per element of the parameters ZeRO-3 trains (its partitions): 2 or 4 (fp32)."""
    grad_accum_bytes: int = 2
    """Bytes per element of ZeRO-3's gradient accumulation partition (host-side here)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"offload mode must be one of {MODES}, got {self.mode!r}")
        for name in ("param_bytes", "grad_accum_bytes"):
            if getattr(self, name) not in (2, 4):
                raise ValueError(f"{name} must be 2 or 4, got {getattr(self, name)!r}")

    @property
    def device_per_param(self) -> int:
        return {"none": 16, "optimizer": self.param_bytes, "optimizer+params": 0,
                "fsdp2": 0}[self.mode]

    @property
    def host_per_param(self) -> int:
        fp32_state = 16  # master weights, their gradient, AdamW's two moments
        return {"none": 0, "optimizer": fp32_state + self.grad_accum_bytes,
                "optimizer+params": fp32_state + self.grad_accum_bytes + self.param_bytes,
                "fsdp2": fp32_state}[self.mode]

    @property
    def offloaded(self) -> bool:
        return self.mode != "none"

    def device_bytes(self, shard_params: int) -> int:
        """Device bytes of the state of a shard of ``shard_params`` parameters."""
        return self.device_per_param * shard_params + self.device_fixed

    def host_bytes(self, shard_params: int) -> int:
        """Host bytes of the state of a shard of ``shard_params`` parameters."""
        return self.host_per_param * shard_params


def _dtype_bytes(name: object, key: str) -> int:
    if not isinstance(name, str) or name.lower() not in _DTYPE_BYTES:
        raise ValueError(f"{key}={name!r}: expected one of 'fp32', 'bf16', 'fp16'")
    return _DTYPE_BYTES[name.lower()]


def placement_from_ds_config(ds: dict) -> Placement:
    """The placement a DeepSpeed config's ``zero_optimization`` block asks for.

    ``offload_param`` without ``offload_optimizer`` is refused: DeepSpeed would step an
    optimizer on the device over parameters it keeps on the host, which the planner does not
    model. ``device: "nvme"`` is refused too (issue 19's tier).
    """
    zero = ds.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        raise ValueError(f"zero_optimization must be a JSON object, got {zero!r}")

    def target(key: str) -> str | None:
        block = zero.get(key)
        if not block:
            return None
        device = block.get("device", "cpu") if isinstance(block, dict) else None
        if device in ("none", None):
            return None
        if device != "cpu":
            raise ValueError(f"zero_optimization.{key}.device={device!r}: the planner models "
                             f"offload to 'cpu' only")
        return device

    opt, param = target("offload_optimizer"), target("offload_param")
    if param and not opt:
        raise ValueError("zero_optimization.offload_param without offload_optimizer: the "
                         "planner models offload_param only with the optimizer offloaded too")
    if not opt:
        return Placement("none")
    # DeepSpeed's get_data_types() and communication_data_type: the training dtype is bf16 or
    # fp16 when enabled, else fp32; the other two default to it.
    half = any((ds.get(k) or {}).get("enabled", False) for k in ("bf16", "bfloat16", "fp16"))
    param_bytes = 2 if half else 4
    accum = (ds.get("data_types") or {}).get("grad_accum_dtype")
    accum_bytes = param_bytes if accum is None else _dtype_bytes(
        accum, "data_types.grad_accum_dtype")
    comm = ds.get("communication_data_type")
    comm_bytes = param_bytes if comm is None else _dtype_bytes(comm, "communication_data_type")
    if int(ds.get("sequence_parallel_size", 1)) > 1:
        # With sequence parallelism (an SP mpu, as arctic.initialize gives it) DeepSpeed's
        # engine replaces the communication dtype with seq_parallel_communication_data_type
        # (default fp32), and the ZeRO-3 bucket is allocated in it.
        sp_comm = ds.get("seq_parallel_communication_data_type", "fp32")
        comm_bytes = _dtype_bytes(sp_comm, "seq_parallel_communication_data_type")
    bucket = int(zero.get("reduce_bucket_size", DS_REDUCE_BUCKET_SIZE))
    if not zero.get("contiguous_gradients", True):
        bucket = 0  # DeepSpeed allocates the bucket only to copy gradients into contiguously
    return Placement("optimizer+params" if param else "optimizer",
                     device_fixed=bucket * comm_bytes, param_bytes=param_bytes,
                     grad_accum_bytes=accum_bytes)


def offload_pool_limit(placement: Placement, num_params: int, world: int, *,
                       group=None) -> int | None:
    """The activation offload pool's host limit when ``placement`` puts training state on the
    host: the pool's default (80% of the host's available memory per local rank, agreed over
    ``group``: :func:`offload.activations.default_host_limit`) less this rank's share of the
    state (a shard of ``ceil(num_params / world)`` parameters), so that the offloaded layer
    inputs and the state share one budget, as the planner counts them. ``None`` (the pool's
    default) when nothing is offloaded. Called before the state is allocated, as
    :func:`arctic.initialize` does; ``ValueError`` if the state alone takes the budget."""
    if not placement.offloaded:
        return None
    budget = activations.default_host_limit(group)
    state = placement.host_bytes(-(-num_params // world))
    if state >= budget:
        raise ValueError(f"the training state offloaded to the host ({placement.mode}) needs "
                         f"{state / 2**30:.2f} GiB per rank, the whole offload budget of "
                         f"{budget / 2**30:.2f} GiB (80% of available host memory per local "
                         f"rank): no room is left for offloaded activations. Fix: add ranks, "
                         f"or turn offload_activations off")
    return budget - state


__all__ = ["DS_REDUCE_BUCKET_SIZE", "MODES", "Placement", "offload_pool_limit",
           "placement_from_ds_config"]
