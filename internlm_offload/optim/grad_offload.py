"""Gradient offload (ZeRO-Offload's schedule): every gradient leaves the device as backward produces it.

What it may touch: the model's parameters' `.grad` (taken and dropped by a post-accumulate-grad hook), the
`host_grad` field of the masters' `ParamRecord`s (optim/records.py: views of one host buffer, which the swap
and hybrid optimizers read instead of a device gradient), and the accelerator's streams, host memory and
host threads. It never reads a config.

Schedule of one micro-batch's backward (device picture; the cpu backend runs it on worker threads):
- a parameter's hook takes its gradient into the open bucket (about `bucket_bytes` of gradients in their
  own dtype, a larger gradient alone) and drops `.grad`: the device keeps a gradient only until its bucket
  has been copied out;
- a full bucket goes D2H on the copy stream into one of two pinned staging buffers, after the copy stream
  waited for the compute stream (backward wrote the gradients); the grads are `record_stream`ed, so the
  allocator does not hand their memory out before the copy read it;
- a host thread waits for the copy and adds the staged bucket into the host gradients, in the stepped
  parameter's dtype (fp32 for fp32 masters): the first micro-batch of a step copies, later ones add;
- a bucket waits for its staging buffer only while the one before the last is still being copied or
  added: the copies fall behind backward only when the host link or the host's adds are the slower part;
- after backward the trainer calls `accumulate_grads()`, which sends the last, partial bucket.
`grads()` waits for every add and returns the host gradients, which clipping, the non-finite guard and the
optimizer's step read. The device never holds the fp32 gradient buffer of the masters.

Data parallelism (`reduce=True`, DDP's layout without its wrapper): once per step, after the last
backward (`reduce_grads`), the host sums are averaged over the ranks bucket by bucket on the device: a
bucket goes H2D in the stepped dtype, is all-reduced and comes back over the host gradients. The buckets
are fixed at construction, in parameter order, so every rank issues the same all-reduces whatever its
graph used (a parameter without a gradient on a rank takes part as zeros); hook order, which decides the
backward buckets, may differ between ranks (an MoE router's choice of experts), and mismatched
collectives would hang. The sums are the ones the run without offload all-reduces, as one fp32 buffer.
Cost: 2 x (stepped dtype's bytes) per parameter over the host link per step, after backward.

FSDP2 (DTensor parameters, its fp32 shards the masters): FSDP2 calls the hook on each sharded parameter
once its reduce-scattered gradient shard is accumulated; that shard is what moves, and the host holds this
rank's shards. `grads()` returns them laid out as the parameters' DTensors, so the gradient norm is taken
over all ranks (a host tensors' collective: the device's group has gloo beside it); a record's `host_grad` is
the local shard, which the optimizers' CPU side works on.

Numerics: the host adds are the additions the run without offload does on the device, in the same order
(micro-batch by micro-batch), so gradients are bitwise that run's. With fp32 masters it adds into a zeroed
buffer (`MasterWeights`): here the first gradient is added to 0.0 too (which turns -0.0 into +0.0), and a
parameter without a gradient gets zeros. Otherwise autograd keeps the first gradient as it is and leaves
`.grad` None without one: so does this class.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from internlm_offload.device import Accelerator, CopyLane, Event, HostArena, aligned_views, finish_and_close, round_up
from internlm_offload.features import MemoryFeature
from internlm_offload.log import get_logger
from internlm_offload.optim.adamw import consecutive_runs
from internlm_offload.optim.dtensor import laid_out_like, local_shard
from internlm_offload.optim.records import Masters, ParamRecord

logger = get_logger(__name__)

STAGING_BUFFERS = 2  # one bucket on the link while the host adds the one before
_ALIGNMENT = 64  # bytes between gradients in a staging buffer


@dataclass(eq=False)
class _Bucket:
    """Gradients taken by the hooks and not yet sent: (index of the parameter, its device gradient)."""

    grads: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    nbytes: int = 0


class GradOffload(MemoryFeature):
    """The masters' gradient interface (`Masters`) over host-resident gradients; see the module docstring.

    Works on `masters.records()`: hooks on each record's `model` (whose `.grad` backward produces), host
    gradients shaped like its `master` (the parameter the optimizer steps; the two are one tensor without fp32
    masters), handed over in its `host_grad` from `grads()` until `release_grads()`. `from_zeros` (fp32
    masters): the first gradient of a step is added to zeros and parameters without one get zeros; else the
    first is kept as it is and those get none (autograd's rule). `reduce`: average the host gradients over the
    ranks of `group` (the default process group's when None) after the last backward, on the device bucket by
    bucket (DDP; module docstring).
    """

    def __init__(
        self,
        masters: Masters,
        accelerator: Accelerator,
        *,
        bucket_bytes: int,
        from_zeros: bool,
        reduce: bool = False,
        reduce_apart: tuple[set[int], Callable[[torch.Tensor], None]] | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self._masters = masters
        self._group = group  # whom `reduce` averages over (None: the world; a pipeline stage's data-parallel ranks)
        self.module = masters.module
        self._acc = accelerator
        self._records = masters.records()
        self._local = [local_shard(r.master.detach()) for r in self._records]  # this rank's shards (FSDP2)
        self._from_zeros = from_zeros
        self._reduce = reduce
        # (ids of model parameters, reduce): their gradients travel in buckets of their own, reduced by `reduce`
        # instead of averaged over every rank (expert parallel's experts, whose shards differ across ranks)
        apart_ids, self._reduce_apart = reduce_apart if reduce_apart is not None else (set(), None)
        self._apart = [id(r.model) in apart_ids for r in self._records]
        self._device = self._records[0].model.device if self._records else torch.device("cpu")  # backward's
        self._host = HostArena(accelerator, [(p.shape, p.dtype) for p in self._local], pinned=True)
        self._host_grads = [self._host.view(i) for i in range(len(self._records))]
        self._landed = [False] * len(self._records)
        # Bucket sizes count the stepped dtype's bytes, which a reduced bucket travels in (fp32 for masters).
        sizes = [round_up(p.numel() * p.element_size(), _ALIGNMENT) for p in self._local]
        # A bucket holds at least the largest gradient, and need not exceed all of them (a small model).
        self._capacity = max(min(bucket_bytes, sum(sizes)), max(sizes, default=0))
        self._staging = [accelerator.host_empty((self._capacity,), torch.uint8) for _ in range(STAGING_BUFFERS)]
        self._in_flight: list[Future | None] = [None] * STAGING_BUFFERS
        self._next_staging = 0
        self._bucket = _Bucket()
        # Fixed by parameter order and dtype (module docstring), each within a staging buffer.
        self._reduce_buckets = (
            consecutive_runs(
                range(len(self._local)),
                group_of=lambda index: (self._local[index].dtype, self._apart[index]),
                size_of=lambda index: sizes[index],
                target=self._capacity,
            )
            if reduce
            else []
        )
        self._lane = CopyLane(accelerator)
        self._worker = accelerator.host_worker("grad-offload")
        self._hooks = [
            record.model.register_post_accumulate_grad_hook(functools.partial(self._take_grad, index))
            for index, record in enumerate(self._records)
        ]
        logger.info(
            "Gradient offload: %d gradients to %.1f MiB of pinned host memory, buckets of %.1f MiB",
            len(self._records),
            self._host.nbytes / 2**20,
            self._capacity / 2**20,
        )

    # ---- what the trainer calls (the `Masters` interface) -----------------------------------------

    @property
    def on_host(self) -> bool:
        return self._masters.on_host

    @property
    def reduce_in_backward(self) -> bool:
        """False: the data-parallel wrapper must not reduce gradients this class takes away in backward."""
        return False

    def master_params(self) -> Iterator[nn.Parameter]:
        return self._masters.master_params()

    def records(self) -> list[ParamRecord]:
        """The wrapped masters' records, whose `host_grad` this class writes."""
        return self._masters.records()

    def accumulate_grads(self) -> None:
        """After a micro-batch's backward: take the gradients no hook saw (a zero-bubble pipeline schedule's
        weight pass assigns `.grad` itself), then send the last, partial bucket."""
        for index, record in enumerate(self._records):
            if record.model.grad is not None:
                self._take_grad(index, record.model)
        self._send()

    def reduce_grads(self, distributed: bool) -> None:
        """Average the host gradients over the ranks, bucket by bucket on the device (module docstring)."""
        if not (distributed and self._reduce):
            return  # one rank, or FSDP2's reduce-scatter reduced them already
        self._send()
        self._finish_adds()  # the sums go back in: every add must have landed
        for indices in self._reduce_buckets:
            self._ship(indices, self._reduced(indices), replace=True)

    def grads(self) -> list[torch.Tensor]:
        """This step's host gradients, once every bucket has been added (as DTensors for DTensor params); their
        local tensors are the records' `host_grad`s now."""
        self._send()
        self._finish_adds()
        grads = []
        for record, host, landed in zip(self._records, self._host_grads, self._landed):
            if not landed and self._from_zeros:
                host.zero_()
            record.host_grad = host if landed or self._from_zeros else None
            if record.host_grad is not None:
                grads.append(laid_out_like(host, record.master))
        return grads

    def copy_to_model(self) -> None:
        self._masters.copy_to_model()

    def after_step(self) -> None:
        self._masters.after_step()

    def release_grads(self) -> None:
        """The step is over: the next micro-batch starts the host gradients afresh."""
        for record in self._records:
            record.host_grad = None
        self._landed = [False] * len(self._records)
        self._masters.release_grads()

    # ---- MemoryFeature ------------------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        staging = sum(buffer.numel() for buffer in self._staging)
        return {"grad_offload_host_bytes": float(self._host.nbytes + staging)}

    def close(self) -> None:
        """Remove the hooks, finish the copies and adds, stop the copy stream and the host thread."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._finish_adds()
        self._worker.shutdown()
        finish_and_close(self._lane.stream)

    # ---- the schedule -------------------------------------------------------------------------------

    def _take_grad(self, index: int, param: nn.Parameter) -> None:
        """Post-accumulate-grad hook: the gradient joins the open bucket and leaves `.grad`."""
        grad = local_shard(param.grad)  # FSDP2: the reduce-scattered shard
        param.grad = None
        nbytes = round_up(grad.numel() * self._local[index].element_size(), _ALIGNMENT)
        if self._bucket.nbytes + nbytes > self._capacity:
            self._send()
        self._bucket.grads.append((index, grad))
        self._bucket.nbytes += nbytes

    def _send(self) -> None:
        """Copy the open bucket to a staging buffer on the copy stream; the host thread adds it when it lands
        (or, reducing, writes the reduced sums over the host gradients)."""
        bucket, self._bucket = self._bucket, _Bucket()
        if bucket.grads:
            self._ship([index for index, _ in bucket.grads], [grad for _, grad in bucket.grads], replace=False)

    def _ship(self, indices: list[int], outgoing: list[torch.Tensor], replace: bool) -> None:
        """Device tensors of the given parameters to the host: through a staging buffer, added (or written
        over, `replace`) into the host gradients by the host thread."""
        slot = self._next_staging
        self._next_staging = (slot + 1) % STAGING_BUFFERS
        if self._in_flight[slot] is not None:
            self._in_flight[slot].result()  # the staging buffer's last bucket has been added
        staged = aligned_views(self._staging[slot], [(t.shape, t.dtype) for t in outgoing], _ALIGNMENT)
        # After backward (or the reduction) wrote them; they are dropped now and read by the copy later.
        copied = self._lane.copy(staged, outgoing, keep_alive=outgoing)
        self._in_flight[slot] = self._worker.submit(self._land, copied, indices, staged, replace)

    @torch.no_grad()
    def _reduced(self, indices: list[int]) -> list[torch.Tensor]:
        """The parameters' host sums on the device (zeros where this rank has none), averaged over the ranks:
        one flat buffer in their dtype, all-reduced once; a view of it per parameter."""
        stepped = [self._local[index] for index in indices]
        flat = torch.empty(sum(p.numel() for p in stepped), dtype=stepped[0].dtype, device=self._device)
        sums, offset = [], 0
        for index, param in zip(indices, stepped):
            total = flat[offset : offset + param.numel()].view_as(param)
            offset += param.numel()
            if self._landed[index]:
                total.copy_(self._host_grads[index], non_blocking=True)  # pinned: asynchronous on a device
            else:
                total.zero_()
            sums.append(total)
        if self._apart[indices[0]]:  # a bucket is apart or not as a whole (`_reduce_buckets`)
            self._reduce_apart(flat)
        else:
            dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=self._group)
        return sums

    def _finish_adds(self) -> None:
        """Wait until every bucket sent so far has landed in the host gradients."""
        for index, pending in enumerate(self._in_flight):
            if pending is not None:
                pending.result()  # re-raises a failure of the host thread
                self._in_flight[index] = None

    @torch.no_grad()  # grad mode is per thread
    def _land(self, copied: Event, indices: list[int], staged: list[torch.Tensor], reduced: bool) -> None:
        """Host thread: once the bucket is in its staging buffer, add it into the host gradients (reduced
        sums replace them)."""
        copied.synchronize()
        for index, grad in zip(indices, staged):
            host = self._host_grads[index]
            if reduced:
                host.copy_(grad)
            elif self._landed[index]:
                host.add_(grad)
            elif self._from_zeros:
                torch.add(grad, 0.0, out=host)  # 0 + g in one pass: bitwise a zeroed buffer's first add
            else:
                host.copy_(grad)
            self._landed[index] = True
