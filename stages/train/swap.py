"""Block swap (train.blocks_to_swap): the denoiser's transformer blocks take turns on the training device.

Of B blocks, at most R = B - N hold their weights on the device at any time; the others wait in (pinned) CPU
memory. The forward runs blocks 0..B-1 and the backward B-1..0, so one rule serves both directions: when block i
is done, its storage is freed and block i + R (forward) or i - R (backward) is copied in on a side stream while
the blocks in between compute. Each step starts with blocks 0..R-1 resident and ends there.

A released weight keeps its Parameter, shape and dtype but its storage is resized to 0 bytes (as FSDP frees
parameters), which also frees the copies autograd saved for backward (they share the storage). Touching a block
while it is out therefore fails at once, on the CPU as on a GPU, rather than silently reading stale memory.

LoRA: only the frozen base weights swap; the adapter weights stay on the device. Full fine-tune: every weight of
a swapped block swaps; between steps its authoritative copy is the CPU one (`home`), which the optimizer updates,
so its gradient and optimizer state live on the CPU too (one process only: DDP's buckets cannot follow).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from tuneline.stages.families.common import unwrap


def transformer_blocks(denoiser: torch.nn.Module, stacks: tuple[str, ...]) -> list[torch.nn.Module]:
    """The denoiser's transformer blocks in the order its forward runs them: the blocks of each of the family's
    block stacks (Family.block_stacks) in turn."""
    den = unwrap(denoiser)
    return [b for path in stacks for b in den.get_submodule(path)]


def max_blocks_to_swap(blocks: int) -> int:
    """One block stays on the device (with one, each copy waits for the block before it to finish; with two or
    more, a copy overlaps the blocks in between)."""
    return max(0, blocks - 1)


def _leaves(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding `t`'s data: itself, or a quantized tensor subclass's inner tensors (torchao)."""
    if not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [leaf for n in names for leaf in _leaves(getattr(t, n))]


def _fresh(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` in storage of its own that can be freed and refilled (a loaded checkpoint's may be a
    memory-mapped file's, which cannot)."""
    if not is_traceable_wrapper_subclass(t):
        return torch.empty_like(t).copy_(t)
    names, ctx = t.__tensor_flatten__()
    return type(t).__tensor_unflatten__({n: _fresh(getattr(t, n)) for n in names}, ctx, t.shape, t.stride())


class _Arrive(torch.autograd.Function):
    """Identity on a block's outputs; its backward runs just before the block's own backward."""

    @staticmethod
    def forward(ctx, swapper, index, *tensors):
        ctx.swapper, ctx.index = swapper, index
        return tensors[0].view_as(tensors[0]) if len(tensors) == 1 else tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.swapper.before_backward(ctx.index)
        return (None, None, *grads)


class BlockSwapper:
    def __init__(
        self, denoiser: torch.nn.Module, stacks: tuple[str, ...], blocks_to_swap: int, device: torch.device, full: bool
    ):
        self.blocks = transformer_blocks(denoiser, stacks)
        b, n = len(self.blocks), blocks_to_swap
        if not 0 < n <= max_blocks_to_swap(b):
            raise ValueError(
                f"train.blocks_to_swap {n}: {type(unwrap(denoiser)).__name__} has {b} transformer "
                f"blocks, so at most {max_blocks_to_swap(b)} can swap (one stays on the device); "
                f"set train.blocks_to_swap between 0 and {max_blocks_to_swap(b)}"
            )
        self.device, self.full, self.resident_limit = device, full, b - n
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        # per block: [(param, its device tensor, that tensor's leaves, their CPU masters, their storage bytes)]
        self.weights: list[list[tuple]] = [self._masters(blk) for blk in self.blocks]
        self.loaded = set(range(b))
        self.pending: dict[int, object] = {}  # block -> CUDA event of its copy in flight
        self.max_resident, self.phase_backward, self.bwd_next, self.at_home = b, set(), b - 1, False
        for i in range(self.resident_limit, b):
            self.release(i)
        self.max_resident = len(self.loaded)
        if full:
            self.home()
        self.hooks = [unwrap(denoiser).register_forward_pre_hook(lambda m, a: self.start_step())]
        for i, blk in enumerate(self.blocks):
            self.hooks.append(blk.register_forward_pre_hook(lambda m, a, i=i: self.wait(i, "forward")))
            self.hooks.append(blk.register_forward_hook(lambda m, a, out, i=i: self.after_forward(i, out)))
        # DDP (LoRA) never reads a swapped weight: it wraps with init_sync=False and only the trainable
        # (adapter) weights take part (tuneline.stages.train.collectives.wrap).

    def swaps(self, p: torch.nn.Parameter) -> bool:
        return self.full or not p.requires_grad

    def _masters(self, block: torch.nn.Module) -> list[tuple]:
        out = []
        for p in block.parameters():
            if not self.swaps(p):
                continue
            slot = _fresh(p.data)
            p.data = slot
            leaves = _leaves(slot)
            masters = [leaf.detach().to("cpu", copy=True) for leaf in leaves]
            if self.cuda:
                masters = [m.pin_memory() for m in masters]
            sizes = [leaf.untyped_storage().nbytes() for leaf in leaves]
            out.append((p, slot, leaves, masters, sizes))
        return out

    # ---- moving weights ----------------------------------------------------------------------
    def release(self, i: int) -> None:
        if i in self.pending:
            self.wait(i, "release")
        for p, slot, leaves, _, _ in self.weights[i]:
            for leaf in leaves:
                leaf.untyped_storage().resize_(0)
            if not self.at_home:
                self._show(p, slot, False)
        self.loaded.discard(i)

    def _show(self, p: torch.nn.Parameter, slot: torch.Tensor, loaded: bool) -> None:
        """A released plain weight is an empty placeholder, so a read outside the schedule fails with a shape
        error (a freed storage under the old shape would be read out of bounds); quantized weights keep their
        freed storage, as the schedule's own checks guard them."""
        if is_traceable_wrapper_subclass(slot):
            return
        p.data = slot if loaded else torch.empty(0, dtype=slot.dtype, device=slot.device)

    def prefetch(self, i: int) -> None:
        """Copy block i in; on a GPU on the side stream, after the work queued so far (which may still read the
        memory the allocator hands out again)."""
        if i in self.loaded or i in self.pending:
            return
        for p, slot, leaves, _, sizes in self.weights[i]:
            for leaf, size in zip(leaves, sizes):
                leaf.untyped_storage().resize_(size)
            if not self.at_home:
                self._show(p, slot, True)
        if not self.cuda:
            self._copy(i)
            self.loaded.add(i)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                self._copy(i)
                self.pending[i] = torch.cuda.Event()
                self.pending[i].record(self.stream)
        self.max_resident = max(self.max_resident, len(self.loaded) + len(self.pending))

    def _copy(self, i: int) -> None:
        for _, _, leaves, masters, _ in self.weights[i]:
            for leaf, master in zip(leaves, masters):
                leaf.copy_(master, non_blocking=True)

    def wait(self, i: int, why: str) -> None:
        if i in self.pending:
            torch.cuda.current_stream(self.device).wait_event(self.pending.pop(i))
            self.loaded.add(i)
        if i not in self.loaded:
            raise RuntimeError(
                f"block swap: block {i} is needed ({why}) while it is swapped out; the swap "
                f"schedule assumes each block runs once per forward, in order"
            )

    # ---- the schedule ------------------------------------------------------------------------
    def start_step(self) -> None:
        """Every forward starts from blocks 0..R-1 resident (a no-op after a full step; after an evaluation or an
        interrupted step it restores the layout)."""
        if self.full:
            self.park()
        r, b = self.resident_limit, len(self.blocks)
        for i in range(r, b):
            if i in self.loaded or i in self.pending:
                self.release(i)
        for i in range(r):
            self.prefetch(i)
        self.phase_backward, self.bwd_next = set(), b - 1

    def after_forward(self, i: int, out):
        if i in self.phase_backward:  # recomputed under gradient checkpointing, inside the backward
            return out
        if torch.is_grad_enabled():
            out = self._mark(i, out)
        nxt = i + self.resident_limit
        if nxt < len(self.blocks):
            self.release(i)
            self.prefetch(nxt)
        elif i == len(self.blocks) - 1 and not torch.is_grad_enabled() and self.full:
            self.home()  # an evaluation: no backward follows
        return out

    def _mark(self, i: int, out):
        tensors = out if isinstance(out, tuple) else (out,)
        idx = [k for k, t in enumerate(tensors) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            return out
        marked = _Arrive.apply(self, i, *[tensors[k] for k in idx])
        marked = marked if isinstance(marked, tuple) else (marked,)
        new = list(tensors)
        for k, t in zip(idx, marked):
            new[k] = t
        return tuple(new) if isinstance(out, tuple) else new[0]

    def before_backward(self, i: int) -> None:
        """Block i's backward is next, so every later block's backward is done: each of those releases its
        weights and sends for the block R before it."""
        for k in range(self.bwd_next, i, -1):
            if k - self.resident_limit >= 0:
                self.release(k)
                self.prefetch(k - self.resident_limit)
        self.bwd_next = min(self.bwd_next, i)
        self.phase_backward.add(i)
        self.wait(i, "backward")

    # ---- full fine-tune: the CPU copy is the weight between steps ----------------------------
    def home(self) -> None:
        """Point each swapped parameter at its CPU master (with its gradient), for the optimizer step, EMA,
        checkpoints and exports, and free every device copy: the optimizer changes the masters, so the next
        forward copies them in afresh."""
        self.evict()
        if self.at_home:
            return
        self.at_home = True
        for entries in self.weights:
            for p, _, _, masters, _ in entries:
                grad = p.grad
                p.data = masters[0]
                if grad is not None:
                    p.grad = grad.to(masters[0].device)

    def evict(self) -> None:
        """Free every block's device copy (another timestep expert runs now); the next forward copies 0..R-1 in."""
        for i in range(len(self.blocks)):
            if i in self.loaded or i in self.pending:
                self.release(i)

    def park(self) -> None:
        if not self.at_home:
            return
        self.at_home = False
        for i, entries in enumerate(self.weights):
            for p, slot, _, _, _ in entries:
                p.data = slot
                self._show(p, slot, i in self.loaded or i in self.pending)


class ExpertSwappers:
    """Block swap of a denoiser of timestep experts that runs one expert per forward (a training step draws in one
    expert's share: SigmaSampler.step_share): each expert swaps train.blocks_to_swap of its own blocks, and when one
    starts a forward the others free the blocks they kept on the device, so it holds one expert's at a time."""

    def __init__(self, swappers: list[BlockSwapper], parts: list[torch.nn.Module]):
        self.swappers, self.full = swappers, swappers[0].full
        for i, part in enumerate(parts):
            part.register_forward_pre_hook(lambda m, a, i=i: self.start(i), prepend=True)  # evict first

    def start(self, i: int) -> None:
        for k, other in enumerate(self.swappers):
            if k != i:
                other.evict()

    def home(self) -> None:
        for swapper in self.swappers:
            swapper.home()


def block_swapper(fam, denoiser: torch.nn.Module, t, device: torch.device) -> BlockSwapper | ExpertSwappers | None:
    """train.blocks_to_swap's swapper of `denoiser`'s block stacks, per timestep expert where it holds several
    (Family.denoiser_parts); None when it is 0."""
    if not t.blocks_to_swap:
        return None
    den, full = unwrap(denoiser), t.mode == "full"
    parts = [p for p in fam.denoiser_parts(den).values() if p is not den]
    if len(parts) < 2:
        return BlockSwapper(denoiser, fam.block_stacks(den), t.blocks_to_swap, device, full)
    swappers = [BlockSwapper(p, fam.block_stacks(p), t.blocks_to_swap, device, full) for p in parts]
    return ExpertSwappers(swappers, parts)
