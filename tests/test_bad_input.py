"""Bad input: a clear error (value, constraint, fix) on every rank, before any collective; never a hang."""

from __future__ import annotations

import collections
import os
import traceback

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

import oslo
from oslo.parallel.comm import RankFailedError
from tests.distributed import run_distributed
from tests.helpers import save_reference, tiny_gpt2_config


@pytest.fixture(scope="module")
def lm_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2-lm")
    save_reference(transformers.GPT2LMHeadModel, tiny_gpt2_config(), path)
    return str(path)


@pytest.mark.parametrize(
    "value, error, fragment",
    [(0, ValueError, "got 0"), (-2, ValueError, "got -2"), (1.5, TypeError, "1.5"), ("2", TypeError, "'2'"),
     (True, TypeError, "True"), (None, TypeError, "None")],
)
def test_tensor_parallel_size_must_be_positive_integer(lm_checkpoint, value, error, fragment):
    with pytest.raises(error, match="tensor_parallel_size must be a positive integer") as info:
        oslo.GPT2LMHeadModel.from_pretrained_with_parallel(lm_checkpoint, tensor_parallel_size=value)
    assert fragment in str(info.value)
    with pytest.raises(error, match="tensor_parallel_size"):
        oslo.GPT2LMHeadModel.from_config_with_parallel(tiny_gpt2_config(), tensor_parallel_size=value)


def test_plain_process_tp1_needs_no_launcher(lm_checkpoint):
    assert "RANK" not in os.environ and not torch.distributed.is_initialized()
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(lm_checkpoint)
    assert model.mpu.get_tensor_parallel_world_size() == 1 and model.mpu.get_data_parallel_world_size() == 1
    assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 1001)
    assert not torch.distributed.is_initialized()


def test_plain_process_tp2_names_the_launcher(lm_checkpoint):
    with pytest.raises(RuntimeError, match=r"torchrun --nproc_per_node=2") as info:
        oslo.GPT2LMHeadModel.from_pretrained_with_parallel(lm_checkpoint, tensor_parallel_size=2)
    assert "tensor_parallel_size=1" in str(info.value)


def test_missing_path():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        oslo.GPT2LMHeadModel.from_pretrained_with_parallel("/nonexistent/oslo-checkpoint")


def _expect(rank, world_size, path, tp, error, fragments, model_class="GPT2LMHeadModel", **kwargs):
    with pytest.raises(error) as info:
        getattr(oslo, model_class).from_pretrained_with_parallel(path, tensor_parallel_size=tp, **kwargs)
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {info.value}"
    return type(info.value).__name__


def test_heads_not_divisible(lm_checkpoint):
    run_distributed(_expect, 3, lm_checkpoint, 3, ValueError,
                    ["tensor_parallel_size=3", "n_head=4", "[1, 2, 4]"])


def test_sizes_must_divide_world(lm_checkpoint):
    run_distributed(_expect, 2, lm_checkpoint, 4, ValueError, ["= 4 must divide the world size 2"])
    run_distributed(_expect, 3, lm_checkpoint, 2, ValueError, ["= 2 must divide the world size 3"])


def test_more_stages_than_layers(lm_checkpoint):
    run_distributed(_expect, 3, lm_checkpoint, 1, ValueError,
                    ["pipeline_parallel_size=3 exceeds the number of layers (2)", "pipeline_parallel_size <= 2"],
                    pipeline_parallel_size=3)


@pytest.mark.parametrize("value, error", [(0, ValueError), (2.0, TypeError)])
def test_micro_batch_size_must_be_positive_integer(lm_checkpoint, value, error):
    with pytest.raises(error, match=f"micro_batch_size must be a positive integer.*{value}"):
        oslo.GPT2LMHeadModel.from_pretrained_with_parallel(lm_checkpoint, micro_batch_size=value)


def _save_split(rank, world_size, source, target):
    oslo.GPT2LMHeadModel.from_pretrained_with_parallel(source, tensor_parallel_size=world_size) \
        .save_pretrained_with_parallel(target)


def test_missing_split_file(lm_checkpoint, tmp_path):
    run_distributed(_save_split, 2, lm_checkpoint, str(tmp_path))
    os.remove(tmp_path / "model_tp=1_pp=0.safetensors")
    run_distributed(_expect, 2, str(tmp_path), 2, FileNotFoundError, ["model_tp=1_pp=0.safetensors", "incomplete"])


def test_corrupt_split_file_fails_every_rank(lm_checkpoint, tmp_path):
    run_distributed(_save_split, 2, lm_checkpoint, str(tmp_path))
    victim = tmp_path / "model_tp=1_pp=0.safetensors"
    victim.write_bytes(victim.read_bytes()[:-100])  # truncated
    errors = run_distributed(_expect, 2, str(tmp_path), 2, (OSError, RankFailedError),
                             ["model_tp=1_pp=0.safetensors", "truncated or corrupt"])
    assert errors == ["RankFailedError", "OSError"]


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_merged_safetensors(lm_checkpoint, tmp_path, damage):
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((open(os.path.join(lm_checkpoint, name), "rb")).read())
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x07" * 64 + data[64:])
    run_distributed(_expect, 2, str(tmp_path), 2, OSError, ["model.safetensors", "truncated or corrupt"])


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_payload_is_refused(lm_checkpoint, tmp_path):
    marker = tmp_path / "executed"
    reference = transformers.GPT2LMHeadModel.from_pretrained(lm_checkpoint)
    state = dict(reference.state_dict())
    state["evil"] = _Payload(str(marker))
    directory = tmp_path / "ckpt"
    directory.mkdir()
    torch.save(state, directory / "pytorch_model.bin")
    (directory / "config.json").write_text(open(os.path.join(lm_checkpoint, "config.json")).read())
    run_distributed(_expect, 2, str(directory), 2, OSError, ["refusing to load", "nothing was executed"])
    assert not marker.exists()


def test_bad_dtype_and_resize(lm_checkpoint):
    with pytest.raises(ValueError, match="pass only one"):
        oslo.GPT2LMHeadModel.from_pretrained_with_parallel(lm_checkpoint, dtype=torch.float16,
                                                           torch_dtype=torch.float32)
    with pytest.raises(ValueError, match="not a torch dtype"):
        oslo.GPT2LMHeadModel.from_pretrained_with_parallel(lm_checkpoint, dtype="float17")
    with pytest.raises(ValueError, match="resize_token_embeddings must be a positive integer"):
        oslo.GPT2LMHeadModel.from_pretrained_with_parallel(lm_checkpoint, resize_token_embeddings=0)


def _tp3_parity(rank, world_size, path):
    reference = transformers.GPT2LMHeadModel.from_pretrained(path)
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=world_size)
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    torch.testing.assert_close(model(ids).logits, reference(ids).logits)


def test_any_divisor_of_heads_works(tmp_path):
    # tp=3 is not a power of two: any tp dividing the heads is fine.
    save_reference(transformers.GPT2LMHeadModel, tiny_gpt2_config(n_embd=48, n_head=6), tmp_path)
    run_distributed(_tp3_parity, 3, str(tmp_path))


def _labels_outside_vocab(rank, world_size, path, pp):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(
        path, tensor_parallel_size=world_size // pp, pipeline_parallel_size=pp
    )
    input_ids = torch.tensor([[5, 6, 7, 8]])
    labels = torch.tensor([[5, 6, 1001, 8]])  # vocab_size is 1001
    with pytest.raises(ValueError, match=r"token id 1001, outside the vocabulary \[0, 1001\)"):
        out = model(input_ids=input_ids, labels=labels)
        next(iter(out)) if pp > 1 else out.loss
    with torch.no_grad(), pytest.raises(ValueError, match="resize_token_embeddings"):
        model(input_ids=input_ids, labels=labels.masked_fill(labels == 1001, -5))
    assert model(input_ids=input_ids, labels=labels.masked_fill(labels == 1001, -100)) is not None


@pytest.mark.parametrize("pp", [1, 2])
def test_labels_outside_the_vocabulary_fail_every_rank(lm_checkpoint, pp):
    """The vocabulary-split loss cannot see such a label; transformers' loss raises, so do we, on every
    rank (with pipelines, also on the stages that never compute the loss)."""
    run_distributed(_labels_outside_vocab, 2, lm_checkpoint, pp)


def _class_labels_out_of_range(rank, world_size, path, head):
    model = getattr(oslo, head).from_pretrained_with_parallel(path, pipeline_parallel_size=2, num_labels=3)
    input_ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    labels = torch.tensor([0, 3]) if head == "GPT2ForSequenceClassification" else torch.tensor([[0, 1, 2, 3]] * 2)
    with pytest.raises(ValueError, match=r"labels hold the class 3, outside \[0, 3\) for num_labels=3"):
        model(input_ids=input_ids, labels=labels)


@pytest.mark.parametrize("head", ["GPT2ForSequenceClassification", "GPT2ForTokenClassification"])
def test_class_labels_out_of_range_fail_every_stage(lm_checkpoint, head):
    """Only the last stage computes the loss; every stage must raise, not wait for it."""
    run_distributed(_class_labels_out_of_range, 2, lm_checkpoint, head)


def _ids_outside_vocab(rank, world_size, path, tp, bad):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(
        path, tensor_parallel_size=tp, pipeline_parallel_size=world_size // tp
    )
    ids = torch.tensor([[5, 6, bad, 8]])
    message = rf"input_ids hold {bad} at index \(0, 2\), outside the vocabulary \[0, 1001\).*resize_token_embeddings"
    with pytest.raises(IndexError, match=message):
        model.train()(input_ids=ids, labels=ids.clamp(0, 1000))  # a training step
    model.eval()
    with torch.no_grad(), pytest.raises(IndexError, match=message):
        model(input_ids=ids)
    with pytest.raises(IndexError, match=message):
        model.generate(ids, max_new_tokens=2, pad_token_id=0)
    with pytest.raises(IndexError, match=r"token_type_ids hold 1001 at index \(0, 1\).*token embedding"):
        model(input_ids=ids.clamp(0, 1000), token_type_ids=torch.tensor([[0, 1001, 0, 0]]))
    with torch.no_grad():  # no rank was left inside a collective: the model goes on
        return model(input_ids=ids.clamp(0, 1000)).logits


@pytest.mark.parametrize("tp, bad", [(2, 1001), (2, 50000), (2, -1), (1, 1001)])
def test_token_ids_outside_the_vocabulary_fail_every_rank(lm_checkpoint, tp, bad):
    """A vocabulary-split embedding would embed such an id as zeros (tp >= 2), and a pipeline's later
    stages would wait for the first (tp=1, pp=2): every rank raises transformers' IndexError instead."""
    reference = transformers.GPT2LMHeadModel.from_pretrained(lm_checkpoint)
    with pytest.raises(IndexError):
        reference(input_ids=torch.tensor([[5, 6, bad, 8]]))
    logits = run_distributed(_ids_outside_vocab, 2, lm_checkpoint, tp, bad, timeout=120)
    expected = reference(input_ids=torch.tensor([[5, 6, bad, 8]]).clamp(0, 1000)).logits
    for rank_logits in logits:
        torch.testing.assert_close(rank_logits, expected)


def test_token_ids_outside_the_vocabulary_single_process(lm_checkpoint):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(lm_checkpoint)
    for bad in (1001, -1):
        with pytest.raises(IndexError, match=rf"input_ids hold {bad} at index \(0, 1\)"):
            model(torch.tensor([[5, bad]]))


class _CountRangeReads(TorchDispatchMode):
    """Counts the ops of a range check: a min and a max of an id tensor (``aminmax``), stacked to be read."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


def test_a_decoding_step_reads_its_ids_range_once(lm_checkpoint):
    """Each call of the model checks its token ids and positions, reading their minima and maxima (on a GPU, a
    wait for the device). A call nested in another (generate()'s step calls the head, the head its body, both with
    the same tensors) does not read again what the outermost call found in range, and reads the rest at once:
    a decoding step of generate() reads two tensors (its new tokens, their positions) in one read. Ids out of
    range in a step still raise (tests above: positions past the table mid-generate)."""
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(lm_checkpoint).eval()
    ids = torch.randint(3, 1001, (2, 5), generator=torch.Generator().manual_seed(0))
    counts = []
    for new_tokens in (2, 3):
        with _CountRangeReads() as mode:
            model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
        counts.append(mode.counts)
    step = {op: counts[1][op] - counts[0][op] for op in (torch.ops.aten.aminmax.default, torch.ops.aten.stack.default)}
    assert step == {torch.ops.aten.aminmax.default: 2, torch.ops.aten.stack.default: 1}


class _HostReads(TorchDispatchMode):
    """Where oslo's code reads a tensor's values on the host (``.item()``, ``int()``, ``bool()``, ``.tolist()``): on a
    GPU each is a wait for the device. Records the function of oslo's that read (``None``: transformers' code read,
    e.g. its causal mask's ``_ignore_causal_mask_sdpa``, as it does under transformers' model)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = []

    def _record(self) -> None:
        frames = [frame for frame in traceback.extract_stack()[:-2]
                  if f"{os.sep}oslo{os.sep}" in frame.filename or f"{os.sep}transformers{os.sep}" in frame.filename]
        self.reads.append(frames[-1].name if frames and f"{os.sep}oslo{os.sep}" in frames[-1].filename else None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self._record()
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        tolist = self._tolist = torch.Tensor.tolist
        mode = self

        def counted(tensor, *args):
            mode._record()
            return tolist(tensor, *args)

        torch.Tensor.tolist = counted
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)


def test_a_training_call_reads_its_inputs_once(lm_checkpoint):
    """A training call checks its ids, its attention mask's longest row against the positions and its labels against
    the vocabulary, and reads all of them in one ``.tolist()`` (on a GPU, one wait for the device, where it was
    three). The only other read is the loss's, on a CPU only (it leaves out the ignored tokens there). Bad labels
    and too long a mask still raise (the labels then read again, to name the value)."""
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(lm_checkpoint).train()
    ids = torch.randint(3, 1001, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    labels = ids.clone()
    labels[:, :2] = -100
    with _HostReads() as mode:
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert [read for read in mode.reads if read not in (None, "linear_cross_entropy")] == ["_read"], mode.reads
    with pytest.raises(ValueError, match="labels hold the token id 1001"):
        model(input_ids=ids, attention_mask=mask, labels=labels.masked_fill(labels == -100, 1001))
    with pytest.raises(ValueError, match="labels hold the token id -5"):
        model(input_ids=ids, attention_mask=mask, labels=labels.masked_fill(labels == -100, -5))
    with pytest.raises(IndexError, match=r"a row of its attention mask holds 65 tokens"):  # n_positions=64
        model(input_ids=torch.randint(3, 1001, (2, 65)), attention_mask=torch.ones(2, 65, dtype=torch.long))


def _ids_differ(rank, world_size, path):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=2)
    ids = torch.tensor([[5, 6, 7, 1001 if rank == 1 else 8]])
    with pytest.raises(IndexError) as info:
        model(input_ids=ids)
    model(input_ids=torch.tensor([[5, 6, 7, 8]]))  # still in step
    return str(info.value)


def test_an_id_outside_the_vocabulary_on_one_rank_fails_every_rank(lm_checkpoint):
    """Rank 0's ids are fine, rank 1's are not: rank 0 must not go on alone into the forward pass."""
    mine, theirs = run_distributed(_ids_differ, 2, lm_checkpoint, timeout=60)
    assert theirs.startswith("input_ids hold 1001 at index (0, 3)"), theirs
    assert mine.startswith("global rank 1 (tensor-parallel rank 1): input_ids hold 1001"), mine
    assert "found its own inputs fine: the ranks were given different inputs" in mine, mine


def _unseeded_batch(rank, world_size, path):
    from oslo.parallel import InputMismatchError

    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=2)
    torch.seed()  # what a fresh process under torchrun starts from: a seed of its own
    with pytest.raises(InputMismatchError) as values:
        model(input_ids=torch.randint(3, 1001, (2, 8)))
    with pytest.raises(InputMismatchError) as shapes:
        model(input_ids=torch.randint(3, 1001, (2, 8 + rank)))
    torch.manual_seed(1234)  # the fix the message names: the same seed on every rank, before drawing
    model(input_ids=torch.randint(3, 1001, (2, 8)))
    return str(values.value), str(shapes.value)


def test_a_batch_drawn_without_a_seed_is_named_as_the_cause(lm_checkpoint):
    """Same shapes, other values on each rank: the message names the unseeded generator and the seed to set,
    beside the sampler advice; a shape that differs is not blamed on the seed."""
    for values, shapes in run_distributed(_unseeded_batch, 2, lm_checkpoint, timeout=60):
        for fragment in ("tensor int64 of shape (2, 8)", "unseeded random generator", "differs on every process",
                         "torch.manual_seed(1234)", "the same seed on every rank", "DistributedSampler("):
            assert fragment in values, f"{fragment!r} not in {values}"
        assert "DistributedSampler(" in shapes and "shape (2, 9)" in shapes and "seed" not in shapes, shapes


def _positions_outside(rank, world_size, path, tp):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(
        path, tensor_parallel_size=tp, pipeline_parallel_size=world_size // tp
    ).eval()
    ids = torch.randint(3, 1001, (2, 60), generator=torch.Generator().manual_seed(0))
    with pytest.raises(IndexError, match=r"position_ids hold 64 at index \(0, 59\), outside \[0, 64\)"):
        model(input_ids=ids, position_ids=torch.arange(5, 65)[None])
    with pytest.raises(IndexError, match=r"reaches position 64 \(65 tokens after 0 cached\).*max_length=64"):
        model(input_ids=torch.cat([ids, ids[:, :5]], dim=1))
    # generate() runs past n_positions at its fifth new token (transformers raises there too)
    with pytest.raises(IndexError, match=r"position_ids hold 64 .*max_new_tokens"):
        model.generate(ids, max_new_tokens=6, min_new_tokens=6, pad_token_id=0)
    return model.generate(ids, max_new_tokens=4, min_new_tokens=4, pad_token_id=0)


@pytest.mark.parametrize("tp", [1, 2])
def test_positions_outside_the_embedding_fail_every_rank(lm_checkpoint, tp):
    """n_positions is 64. With pipelines only the first stage embeds positions: the others must not
    wait for it."""
    first, second = run_distributed(_positions_outside, 2, lm_checkpoint, tp, timeout=120)
    assert first.shape == (2, 64) and torch.equal(first, second)


def _disagree(rank, world_size, settings, fragments):
    import time

    start = time.monotonic()
    with pytest.raises(ValueError, match="the ranks were given different parallel settings: ") as info:
        oslo.GPT2LMHeadModel.from_config_with_parallel(tiny_gpt2_config(), **settings[rank])
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {info.value}"
    return time.monotonic() - start


@pytest.mark.parametrize("settings, fragment", [
    ([dict(tensor_parallel_size=2), {}], "tensor_parallel_size=2 on ranks [0], tensor_parallel_size=1 on ranks [1]"),
    ([{}, dict(pipeline_parallel_size=2)],
     "pipeline_parallel_size=1 on ranks [0], pipeline_parallel_size=2 on ranks [1]"),
    ([dict(seed=3), {}], "seed=3 on ranks [0], seed=None on ranks [1]"),
    ([dict(tensor_parallel_size=2, seed=3), dict(tensor_parallel_size=2, seed=4)],
     "seed=3 on ranks [0], seed=4 on ranks [1]"),
    ([dict(timeout=20), dict(timeout=25)], "timeout=0:00:20 on ranks [0], timeout=0:00:25 on ranks [1]"),
    ([dict(tensor_parallel_size=2, sequence_parallel=True), dict(tensor_parallel_size=2)],
     "sequence_parallel=True on ranks [0], sequence_parallel=False on ranks [1]"),
    ([dict(pipeline_parallel_size=2), dict(pipeline_parallel_size=2, virtual_pipeline_size=2)],
     "virtual_pipeline_size=1 on ranks [0], virtual_pipeline_size=2 on ranks [1]"),
])
def test_ranks_that_disagree_on_the_layout_fail_every_rank(settings, fragment):
    """Ranks asking for different layouts would create different groups and wait for each other: one
    all-gather before any group exists tells every rank, at once, who asked for what."""
    settings = [dict(dict(timeout=20), **ours) for ours in settings]
    # The message, not a timing, tells the check from the 20 s timeout (which would say "waited").
    run_distributed(_disagree, 2, settings, [fragment, "Pass the same tensor_parallel_size"], timeout=40)


def _layout_cost(rank, world_size, seeds):
    gathered = []
    all_gather = torch.distributed.all_gather

    def counting(outputs, tensor, *args, **kwargs):  # the real collective, counted
        gathered.append((tensor.dtype, tuple(tensor.shape)))
        return all_gather(outputs, tensor, *args, **kwargs)

    torch.distributed.all_gather = counting  # this forked rank's module only
    oslo.parallel.ParallelContext(tensor_parallel_size=1, seed=seeds[rank])
    # rank 0 hosts the store: it must not exit while rank 1 still builds its groups through it
    torch.distributed.barrier()
    return gathered


def test_the_layout_check_is_one_small_all_gather():
    """Data-parallel replicas may take different seeds (only a model-parallel group shares one). Seven int64: the
    sizes, the timeout, the seed (given or not, and its value), sequence_parallel and virtual_pipeline_size."""
    assert run_distributed(_layout_cost, 2, [1, 2], timeout=40) == [[(torch.int64, (7,))]] * 2


def test_split_sizes_name_the_attribute_the_value_and_the_sizes_that_work():
    from oslo.models.base import check_split_sizes

    with pytest.raises(ValueError, match=r"does not divide the number of attention heads \(num_heads=6\).*"
                                         r"Use one of \[1, 2, 3, 6\]"):
        check_split_sizes(4, ("num_heads", 6), ("d_ff", 64))
    with pytest.raises(ValueError, match=r"does not divide the MLP size \(d_ff=30\).*both num_heads=4 and d_ff=30"):
        check_split_sizes(4, ("num_heads", 4), ("d_ff", 30))
    check_split_sizes(2, ("num_heads", 4), ("d_ff", 30))
