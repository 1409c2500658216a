"""Buffers after the meta-device build: every buffer gets its value from the architecture's
``_init_buffers`` at any layout, and a buffer nothing initializes is refused at build time instead of
reaching a forward pass as uninitialized memory (BERT's ``position_ids``, GPT-Neo's masks need this)."""

from __future__ import annotations

import pytest
import torch

import oslo
from tests.distributed import run_distributed
from tests.helpers import tiny_gpt2_config


class _WithBuffers(oslo.GPT2LMHeadModel):
    """A GPT2 with buffers computed in ``__init__``, as BERT's embeddings have."""

    def __init__(self, config, parallel_context=None):
        super().__init__(config, parallel_context)
        self.register_buffer("position_ids", torch.arange(config.n_positions).expand(1, -1), persistent=False)
        self.register_buffer("window", torch.tril(torch.ones(4, 4, dtype=torch.bool)), persistent=False)

    def _init_buffers(self, module):
        if module is self:
            self.position_ids.copy_(torch.arange(self.config.n_positions).expand(1, -1))
            self.window = torch.tril(torch.ones(4, 4, dtype=torch.bool, device=self.window.device))


class _Uninitialized(oslo.GPT2LMHeadModel):
    def __init__(self, config, parallel_context=None):
        super().__init__(config, parallel_context)
        self.register_buffer("position_ids", torch.arange(config.n_positions).expand(1, -1), persistent=False)


def _buffers(rank, world_size):
    model = _WithBuffers.from_config_with_parallel(tiny_gpt2_config(), tensor_parallel_size=world_size)
    return model.position_ids, model.window


@pytest.mark.parametrize("tp", [1, 2])
def test_buffers_get_their_values_at_any_layout(tp):
    for position_ids, window in run_distributed(_buffers, tp, timeout=120):
        assert torch.equal(position_ids, torch.arange(64).expand(1, -1))
        assert torch.equal(window, torch.tril(torch.ones(4, 4, dtype=torch.bool)))


def test_a_buffer_nothing_initializes_is_refused():
    with pytest.raises(NotImplementedError, match=r"\['position_ids'\].*_Uninitialized._init_buffers"):
        _Uninitialized.from_config_with_parallel(tiny_gpt2_config())
