"""How a parameter splits across tensor-parallel ranks.

A :class:`ShardSpec` is declared by the parallel layer that owns a parameter (see ``layers.py``) and
is the single source of truth for every operation that touches weights: reading this rank's slice of
a checkpoint, random initialization, merging the shards back into the Hugging Face tensor, and
counting gradient norms. Parameters without a spec are replicated on every tensor-parallel rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from oslo.parallel.context import ParallelContext

# Kinds of split, named after the layer that produces them.
COLUMN = "column"  # output features of a linear layer
ROW = "row"  # input features of a linear layer
VOCAB = "vocab"  # vocabulary rows of an embedding or LM head, padded to a multiple of the group size

SHARD_KINDS = (COLUMN, ROW, VOCAB)


@dataclass(frozen=True)
class ShardSpec:
    """The slice of a global (checkpoint) tensor that one tensor-parallel rank holds.

    Args:
        kind: ``"column"``, ``"row"`` or ``"vocab"``.
        dim: Dimension of the tensor that is split.
        global_size: Size of that dimension in the checkpoint (unpadded).
        world_size: Number of tensor-parallel ranks.
        rank: This rank's index.
        chunks: The dimension is a concatenation of ``chunks`` equal blocks that are split one by one
            (GPT2's fused ``c_attn`` is ``[q | k | v]``: ``chunks=3``, so each rank holds its heads of
            q, k and v, not a contiguous third).
    """

    kind: str
    dim: int
    global_size: int
    world_size: int
    rank: int
    chunks: int = 1

    def __post_init__(self) -> None:
        if self.kind not in SHARD_KINDS:
            raise ValueError(f"unknown shard kind {self.kind!r}; expected one of {SHARD_KINDS}")
        if self.kind != VOCAB and self.global_size % (self.chunks * self.world_size) != 0:
            raise ValueError(
                f"a {self.kind}-parallel dimension of size {self.global_size} (in {self.chunks} block(s)) "
                f"cannot be split evenly across {self.world_size} tensor-parallel ranks; choose a "
                f"tensor_parallel_size that divides {self.global_size // self.chunks}"
            )

    @property
    def padded_size(self) -> int:
        """Global size including the padding added so that every rank holds the same number of rows."""
        if self.kind == VOCAB:
            return -(-self.global_size // self.world_size) * self.world_size
        return self.global_size

    @property
    def local_size(self) -> int:
        return self.padded_size // self.world_size

    def ranges(self, rank: int | None = None) -> list[tuple[int, int, int]]:
        """``(start, stop, padding)`` triples: the global rows a rank holds, in order, and how many
        zero rows follow them (only vocab splits pad)."""
        rank = self.rank if rank is None else rank
        if self.kind == VOCAB:
            start = min(rank * self.local_size, self.global_size)
            stop = min(start + self.local_size, self.global_size)
            return [(start, stop, self.local_size - (stop - start))]
        block = self.global_size // self.chunks
        per_rank = block // self.world_size
        return [(c * block + rank * per_rank, c * block + (rank + 1) * per_rank, 0) for c in range(self.chunks)]

    def vocab_range(self) -> tuple[int, int]:
        """For vocab splits: the ``[start, stop)`` token ids this rank holds (padding excluded)."""
        (start, stop, _), = self.ranges()
        return start, stop

    def local_shape(self, global_shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
        shape = list(global_shape)
        shape[self.dim] = self.local_size
        return tuple(shape)

    def global_shape(self, local_shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
        shape = list(local_shape)
        shape[self.dim] = self.global_size
        return tuple(shape)

    def shard(
        self,
        read: Callable[[int, int], torch.Tensor],
        available: int | None = None,
        fill: Callable[[int, int], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Build this rank's local tensor from slices of the global one.

        Args:
            read: ``read(start, stop)`` returns the global tensor's rows ``[start, stop)`` along ``dim``
                (a safetensors slice, a view of an in-memory tensor...).
            available: Rows the source actually has along ``dim`` (vocab splits only: a checkpoint
                smaller than the model after ``resize_token_embeddings``). Defaults to ``global_size``.
            fill: ``fill(start, stop)`` makes rows ``[start, stop)`` that the source lacks.
        """
        available = self.global_size if available is None else available
        pieces = []
        for start, stop, padding in self.ranges():
            read_stop = min(stop, available)
            if read_stop > start:
                pieces.append(read(start, read_stop))
            if stop > max(start, read_stop):
                if fill is None:
                    raise ValueError(f"rows [{max(start, read_stop)}, {stop}) are missing from the source")
                pieces.append(fill(max(start, read_stop), stop))
            if padding:
                template = pieces[0] if pieces else read(0, 1)
                shape = list(template.shape)
                shape[self.dim] = padding
                pieces.append(template.new_zeros(shape))
        return torch.cat(pieces, dim=self.dim) if len(pieces) > 1 else pieces[0]

    def slice_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's local tensor cut from the whole (unpadded) tensor ``full`` in memory (vocabulary padding
        rows zero): :meth:`shard` reading views of it."""
        return self.shard(lambda start, stop: full.narrow(self.dim, start, stop - start))

    def merge(self, locals_: list[torch.Tensor]) -> torch.Tensor:
        """Rebuild the global (unpadded) tensor from every rank's local tensor, in rank order."""
        if self.kind == VOCAB:
            return torch.cat(locals_, dim=self.dim).narrow(self.dim, 0, self.global_size)
        per_rank_blocks = [t.chunk(self.chunks, dim=self.dim) for t in locals_]
        blocks = [torch.cat([blocks[c] for blocks in per_rank_blocks], dim=self.dim) for c in range(self.chunks)]
        return torch.cat(blocks, dim=self.dim) if self.chunks > 1 else blocks[0]


def parameter_specs(model: nn.Module) -> dict[str, ShardSpec | None]:
    """Every parameter of ``model`` (tied duplicates once) mapped to its spec (``None``: replicated)."""
    specs: dict[str, ShardSpec | None] = {}
    for module_name, module in model.named_modules():
        declared = getattr(module, "parallel_specs", {})
        for param_name, _ in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            specs[full] = declared.get(param_name)
    names = {name for name, _ in model.named_parameters()}
    return {name: spec for name, spec in specs.items() if name in names}


def specs_by_name(cls: type, config, tensor_parallel_size: int, rank: int) -> tuple[nn.Module, dict]:
    """How the oslo model class ``cls`` splits at ``tensor_parallel_size``, read without processes: the model built
    on the meta device as tensor-parallel rank ``rank`` (no tensor allocated), and every parameter name (tied
    duplicates included) mapped to its spec (``None``: replicated)."""
    context = ParallelContext.planning()
    context.tensor_parallel_size, context.tensor_parallel_rank = tensor_parallel_size, rank
    cls._validate_parallel_config(config, tensor_parallel_size)
    with torch.device("meta"):
        model = cls(config, parallel_context=context)
    by_param = {}
    named = dict(model.named_parameters())
    for name, spec in parameter_specs(model).items():
        by_param[id(named[name])] = spec
    specs = {name: by_param[id(param)] for name, param in model.named_parameters(remove_duplicate=False)}
    return model, specs
