"""Shared test helpers: tiny configs, reference checkpoints, gathering shards for comparison."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import GPT2Config

from oslo.checkpoint import whole_tensor
from oslo.parallel.dtensor import unblock
from oslo.parallel.plan import parameter_specs


def tiny_gpt2_config(**overrides) -> GPT2Config:
    """A GPT2 small enough for multi-rank CPU tests; vocab 1001 is divisible by neither 2 nor 4."""
    values = dict(
        vocab_size=1001, n_positions=64, n_embd=32, n_layer=2, n_head=4, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    values.update(overrides)
    return GPT2Config(**values)


def save_reference(model_cls, config, directory, seed: int = 0, **save_kwargs):
    """Build a transformers model with a fixed seed and save it; returns the model."""
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    model.save_pretrained(directory, **save_kwargs)
    return model


def full_tensors(model, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rebuild global (unsplit) tensors from each rank's local ones, via all-gather over the tp group."""
    context = model.parallel_context
    specs = parameter_specs(model)
    out = {}
    for name, local in tensors.items():
        spec = specs.get(name)
        if local is None:  # no gradient (outside the objective's graph): the same on every rank
            out[name] = None
            continue
        if isinstance(local, DTensor):  # torch assembles it; a fused bias is seen as (chunks, size / chunks)
            out[name] = unblock(local.full_tensor(), spec)
            continue
        out[name] = whole_tensor(local, spec, context)
    return out


def full_grads(model) -> dict[str, torch.Tensor]:
    return full_tensors(model, {n: p.grad for n, p in model.named_parameters()})


def full_params(model) -> dict[str, torch.Tensor]:
    return full_tensors(model, {n: p.detach() for n, p in model.named_parameters()})


def assert_same_grads(reference, model, **tolerances) -> None:
    """Every gradient of ``model`` (gathered) equals the reference's gradient of the same name."""
    ours = full_grads(model)
    theirs = {n: p.grad for n, p in reference.named_parameters()}
    assert set(ours) == set(theirs), (sorted(set(ours) ^ set(theirs)))
    for name, grad in ours.items():
        torch.testing.assert_close(grad, theirs[name], msg=lambda m, n=name: f"gradient of {n}: {m}", **tolerances)


class CountAllReduces:
    """Counts the all-reduces of torch.distributed while entered (the tensor-parallel mappings make them):
    ``all_reduce`` calls, and the ``all_to_all_single`` calls that stand for a small one on gloo
    (:func:`oslo.parallel.collectives.eager_all_reduce`)."""

    def __enter__(self):
        self.count, self.originals = 0, {name: getattr(dist, name) for name in ("all_reduce", "all_to_all_single")}

        def counting(original):
            def count(*args, **kwargs):
                self.count += 1
                return original(*args, **kwargs)
            return count

        for name, original in self.originals.items():
            setattr(dist, name, counting(original))
        return self

    def __exit__(self, *exc):
        for name, original in self.originals.items():
            setattr(dist, name, original)
