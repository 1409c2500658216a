"""Shared helpers of the benchmark scripts: launching gloo ranks (through oslo.launch), timing, memory,
configs and the architectures the scripts measure (GPT2, GPT-Neo, BERT, T5, Llama, Qwen2, Mistral:
:data:`ARCHS`).

Imported by the scripts in this folder (``python benchmarks/<name>.py`` puts the folder on
``sys.path``). Importing it pins the parent process to one torch thread *before* any torch work, so
ranks forked from it never inherit a busy OpenMP pool (forked gloo workers hang otherwise).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import collections
import datetime
import functools
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from transformers import (
    BertConfig,
    GPT2Config,
    GPTNeoConfig,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    T5Config,
)

import oslo.launch as oslo_launch

torch.set_num_threads(1)
transformers.utils.logging.disable_progress_bar()


# ---------------------------------------------------------------------------------------------
# Launching ranks (oslo.launch, the package's one local launcher)
# ---------------------------------------------------------------------------------------------
def launch(fn: Callable[..., Any], world_size: int, *args: Any, threads: int = 1, timeout: float = 600.0,
           env: bool = True) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` forked processes; return their results.

    Each process gets the variables torchrun sets (RANK, WORLD_SIZE, MASTER_ADDR, ...) so oslo
    initializes gloo itself, and ``threads`` torch threads. With ``world_size=1`` and ``env=False``
    the child is a plain process (no launcher variables), as a user's single-process run would be.
    The first rank to fail fails the run at once.
    """
    return oslo_launch.run(fn, world_size, args, threads=threads, timeout=timeout, launcher_variables=env, grace=0.0)


class WorkerGroup(oslo_launch.RankGroup):
    """Long-lived forked ranks that keep their state between timed commands.

    ``setup(rank, world_size, *args)`` runs once in each rank and returns ``handle(command)``;
    :meth:`call` sends a command to every rank and returns their results. Keeping several groups
    alive and alternating commands between them interleaves configurations in time, so that other
    load on the machine hits all of them alike.
    """

    def __init__(self, setup: Callable[..., Callable[[Any], Any]], world_size: int, *args: Any, threads: int = 1,
                 env: bool = True, timeout: float = 600.0) -> None:
        super().__init__(setup, world_size, *args, threads=threads, launcher_variables=env, timeout=timeout)


# ---------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------
def gpt2_config(size: str = "small", n_layer: int | None = None, dropout: float = 0.0,
                **overrides) -> GPT2Config:
    """A GPT2 config of the published shapes (vocab 50257, 1024 positions; ``small``: gpt2, ``medium`` or
    ``large``: gpt2-medium); ``n_layer`` may be reduced."""
    shapes = {"small": (768, 12, 12), "large": (1024, 24, 16)}
    n_embd, layers, n_head = shapes[_size(size)]
    values = {
        "vocab_size": 50257, "n_positions": 1024, "n_embd": n_embd, "n_layer": n_layer or layers,
        "n_head": n_head, "tie_word_embeddings": True, "resid_pdrop": dropout, "embd_pdrop": dropout,
        "attn_pdrop": dropout, "bos_token_id": 50256, "eos_token_id": 50256, "pad_token_id": 50256,
    }
    values.update(overrides)
    return GPT2Config(**values)


def gpt_neo_config(size: str = "small", n_layer: int | None = None, dropout: float = 0.0,
                   window_size: int = 256, **overrides) -> GPTNeoConfig:
    """A GPT-Neo config of the published shapes (``small``: gpt-neo-125M, hidden 768, 12 layers, 12
    heads; ``large``: gpt-neo-1.3B, hidden 2048, 24 layers, 16 heads; vocab 50257, 2048 positions),
    layers alternating global / local attention (window 256) as the checkpoints do."""
    hidden, layers, heads = {"small": (768, 12, 12), "large": (2048, 24, 16)}[_size(size)]
    layers = n_layer or layers
    attention_types = [[["global", "local"], layers // 2]] + ([[["global"], 1]] if layers % 2 else [])
    values = {
        "vocab_size": 50257, "max_position_embeddings": 2048, "hidden_size": hidden, "num_layers": layers,
        "num_heads": heads, "attention_types": attention_types, "window_size": window_size,
        "embed_dropout": dropout, "attention_dropout": dropout, "resid_dropout": dropout,
        "tie_word_embeddings": True, "bos_token_id": 50256, "eos_token_id": 50256, "pad_token_id": 50256,
    }
    values.update(overrides)
    return GPTNeoConfig(**values)


def bert_config(size: str = "small", n_layer: int | None = None, dropout: float = 0.0, **overrides) -> BertConfig:
    """A BERT config of the published shapes (``small``: bert-base, hidden 768, 12 layers, 12 heads, MLP
    3072; ``large``: bert-large, hidden 1024, 24 layers, 16 heads, MLP 4096; vocab 30522, 2 token types,
    512 positions)."""
    hidden, layers, heads = {"small": (768, 12, 12), "large": (1024, 24, 16)}[_size(size)]
    values = {
        "vocab_size": 30522, "type_vocab_size": 2, "max_position_embeddings": 512, "hidden_size": hidden,
        "num_hidden_layers": n_layer or layers, "num_attention_heads": heads, "intermediate_size": 4 * hidden,
        "hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout, "pad_token_id": 0,
        "tie_word_embeddings": True,
    }
    values.update(overrides)
    return BertConfig(**values)


def t5_config(size: str = "small", n_layer: int | None = None, dropout: float = 0.0, **overrides) -> T5Config:
    """A T5 config of the published t5 v1.0 shapes (``small``: t5-small, d_model 512, d_ff 2048, 6 + 6
    layers, 8 heads; ``large``: t5-large, d_model 1024, d_ff 4096, 24 + 24 layers, 16 heads; d_kv 64,
    vocab 32128, dense-relu feed-forward, 32 relative position buckets up to distance 128, embeddings
    tied to the LM head); ``n_layer`` sets the encoder's and the decoder's layer count alike."""
    d_model, d_ff, layers, heads = {"small": (512, 2048, 6, 8), "large": (1024, 4096, 24, 16)}[_size(size)]
    values = {
        "vocab_size": 32128, "d_model": d_model, "d_kv": 64, "d_ff": d_ff, "num_layers": n_layer or layers,
        "num_decoder_layers": n_layer or layers, "num_heads": heads, "relative_attention_num_buckets": 32,
        "relative_attention_max_distance": 128, "dropout_rate": dropout, "feed_forward_proj": "relu",
        "tie_word_embeddings": True, "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0,
    }
    values.update(overrides)
    return T5Config(**values)


def llama_config(size: str = "small", n_layer: int | None = None, dropout: float = 0.0, family: str = "llama",
                 **overrides) -> PretrainedConfig:
    """A Llama-family config of published Llama shapes (``small``: TinyLlama-1.1B, hidden 2048, 22 layers, 32
    query heads over 4 key/value heads, MLP 5632, vocab 32000, untied; ``large``: Llama-3.2-1B, hidden 2048, 16
    layers, 32 heads over 8, MLP 8192, vocab 128256, tied), as ``family``'s config (``qwen2``: biases on q/k/v;
    ``mistral``: its sliding window, 4096 keys, longer than any sequence here)."""
    hidden, layers, heads, kv_heads, inner, vocab, tied = {
        "small": (2048, 22, 32, 4, 5632, 32000, False), "large": (2048, 16, 32, 8, 8192, 128256, True)}[_size(size)]
    values = {
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inner, "num_hidden_layers": n_layer or layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "max_position_embeddings": 2048,
        "tie_word_embeddings": tied, "attention_dropout": dropout, "bos_token_id": 1, "eos_token_id": 2,
        "pad_token_id": 0,
    }
    values.update(overrides)
    return {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[family](**values)


def _size(size: str) -> str:
    return {"small": "small", "medium": "large", "large": "large"}[size]


def describe(config: PretrainedConfig) -> str:
    if config.model_type == "t5":
        return (f"d_model={config.d_model} d_ff={config.d_ff} layers={config.num_layers}+"
                f"{config.num_decoder_layers} heads={config.num_heads} d_kv={config.d_kv} vocab={config.vocab_size} "
                f"feed_forward={config.feed_forward_proj} buckets={config.relative_attention_num_buckets}")
    if config.model_type == "gpt2":
        return (f"n_embd={config.n_embd} n_layer={config.n_layer} n_head={config.n_head} "
                f"vocab={config.vocab_size} n_positions={config.n_positions}")
    text = (f"hidden={config.hidden_size} layers={config.num_hidden_layers} heads={config.num_attention_heads} "
            f"vocab={config.vocab_size} max_position={config.max_position_embeddings}")
    if config.model_type == "gpt_neo":
        kinds = collections.Counter(config.attention_layers)
        text += (f" intermediate={config.intermediate_size or 4 * config.hidden_size} "
                 f"attention {kinds['global']} global + {kinds['local']} local (window {config.window_size})")
    elif config.model_type in ("llama", "qwen2", "mistral"):
        text += f" key_value_heads={config.num_key_value_heads} intermediate={config.intermediate_size}"
    elif config.model_type == "bert":
        text += f" intermediate={config.intermediate_size} type_vocab={config.type_vocab_size}"
        if config.is_decoder:
            text += " is_decoder"
    return text


# ---------------------------------------------------------------------------------------------
# Architectures
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Arch:
    """What the scripts need to know about one architecture: its classes (same names in oslo and
    transformers), its config shapes and its module names (to attribute collectives to regions)."""

    name: str
    lm_class: str  # the language model a training step runs (with labels)
    causal_class: str | None  # the class that generates (None: not measured)
    make_config: Callable[..., PretrainedConfig]
    block_prefix: str  # the blocks are "<block_prefix>.<i>" (an encoder-decoder: the encoder's)
    embedding_prefix: str  # the vocabulary-parallel word embedding
    head_prefix: str  # the vocabulary projection and what runs before it in the head
    masked: bool  # masked-LM labels (15 % of positions, -100 elsewhere) instead of the inputs
    decoder_block_prefix: str | None = None  # encoder-decoder: the decoder's blocks (block_prefix: the encoder's)

    @property
    def seq2seq(self) -> bool:
        """An encoder-decoder: its training call takes target ids as ``labels`` besides ``input_ids``."""
        return self.decoder_block_prefix is not None

    def config(self, size: str = "small", n_layer: int | None = None, dropout: float = 0.0,
               **overrides) -> PretrainedConfig:
        return self.make_config(size, n_layer=n_layer, dropout=dropout, **overrides)

    def oslo_class(self, causal: bool = False) -> type:
        import oslo

        return getattr(oslo, self.causal_class if causal else self.lm_class)

    def hf_class(self, causal: bool = False) -> type:
        return getattr(transformers, self.causal_class if causal else self.lm_class)

    def causal_config(self, config: PretrainedConfig) -> PretrainedConfig:
        """The config ``causal_class`` generates with (BERT: a copy with ``is_decoder=True``)."""
        if self.name != "bert":
            return config
        values = config.to_dict()
        values["is_decoder"] = True
        return type(config)(**values)

    def labels(self, input_ids: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Training labels: the inputs for a causal LM (the model shifts them); for a masked LM the
        input token at 15 % of the positions (drawn with ``generator``), -100 (ignored) elsewhere."""
        if not self.masked:
            return input_ids
        chosen = torch.rand(input_ids.shape, generator=generator) < 0.15
        chosen[..., 0] = True  # at least one labelled position per row
        return torch.where(chosen, input_ids, torch.full_like(input_ids, -100))

    def batch(self, input_ids: torch.Tensor, generator: torch.Generator | None = None,
              target_length: int | None = None) -> dict[str, torch.Tensor]:
        """The keyword arguments of a training call besides ``input_ids``: ``{"labels": ...}``. For a
        decoder-only or encoder model :meth:`labels` (drawing from ``generator`` exactly as it does); for an
        encoder-decoder, target ids of ``target_length`` positions (default: as many as the inputs), each a
        token of its row's input drawn with ``generator`` (so within the vocabulary, no -100); the model
        reads them shifted right as the decoder's input."""
        if not self.seq2seq:
            return {"labels": self.labels(input_ids, generator)}
        batch, length = input_ids.shape
        picks = torch.randint(0, length, (batch, target_length or length), generator=generator)
        return {"labels": input_ids.gather(1, picks)}


ARCHS: dict[str, Arch] = {
    "gpt2": Arch("gpt2", "GPT2LMHeadModel", "GPT2LMHeadModel", gpt2_config, "transformer.h", "transformer.wte",
                 "lm_head", masked=False),
    "gpt_neo": Arch("gpt_neo", "GPTNeoForCausalLM", "GPTNeoForCausalLM", gpt_neo_config, "transformer.h",
                    "transformer.wte", "lm_head", masked=False),
    "bert": Arch("bert", "BertForMaskedLM", "BertLMHeadModel", bert_config, "bert.encoder.layer",
                 "bert.embeddings.word_embeddings", "cls", masked=True),
    "t5": Arch("t5", "T5ForConditionalGeneration", "T5ForConditionalGeneration", t5_config, "encoder.block",
               "shared", "lm_head", masked=False, decoder_block_prefix="decoder.block"),
    **{family: Arch(family, f"{prefix}ForCausalLM", f"{prefix}ForCausalLM",
                    functools.partial(llama_config, family=family), "model.layers", "model.embed_tokens", "lm_head",
                    masked=False)
       for family, prefix in (("llama", "Llama"), ("qwen2", "Qwen2"), ("mistral", "Mistral"))},
}


def arch_names(choice: str) -> list[str]:
    """``--arch`` value (one name, or ``all``) -> the architectures to run, in order."""
    return list(ARCHS) if choice == "all" else [choice]


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------
def median(values: list[float]) -> float:
    return statistics.median(values)


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def alternate(step: Callable[[str], float], names: list[str], rounds: int) -> dict[str, list[float]]:
    """``step(name)``'s times for each variant over ``rounds`` rounds, every variant once per round, the order
    rotating from round to round (so that neither always runs first)."""
    names = list(names)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        for name in names[round_index % 2:] + names[:round_index % 2]:
            times[name].append(step(name))
    return times


def fmt_times(values: list[float]) -> str:
    return ", ".join(f"{v:.3f}" for v in values)


# ---------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------
def proc_status(*fields: str) -> dict[str, int]:
    """Fields of ``/proc/self/status`` in bytes (``VmRSS``, ``VmHWM``, ``RssAnon``, ``RssFile``...)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in fields:
                out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak_rss() -> bool:
    """Reset this process's VmHWM (peak RSS) to its current RSS (Linux >= 4.0); False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------
def cpu_busy(seconds: float = 1.0) -> float:
    """Fraction of all CPUs busy (any process) over the next ``seconds``, from /proc/stat."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        return sum(values), values[3] + values[4]  # total, idle + iowait

    total, idle = sample()
    time.sleep(seconds)
    total2, idle2 = sample()
    return 1.0 - (idle2 - idle) / max(1, total2 - total)


def header(title: str) -> None:
    load = os.getloadavg()
    busy = cpu_busy()
    print(f"== {title}")
    print(f"   {datetime.date.today()} | {platform.processor() or platform.machine()} | "
          f"{os.cpu_count()} CPUs | torch {torch.__version__} | load average {load[0]:.2f} | "
          f"CPUs busy before start {busy:.0%}")
    if busy > 0.1:
        print("   note: other processes are using the CPUs: timings are noisier (and parallel speed-ups "
              "lower) than on an idle machine.")


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"
