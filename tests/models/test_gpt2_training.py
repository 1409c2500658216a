"""Training on any layout equals training on one process: the manual's loops, unchanged, at
(tensor, pipeline, data) parallel sizes, give after an optimizer step the weights that transformers gets
from one step on the whole global batch — left padding, -100 labels and micro-batches (and replicas)
holding different numbers of label tokens included, for every head."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch.nn.parallel import DistributedDataParallel

import oslo
from tests.distributed import run_distributed
from tests.helpers import full_grads, full_params, save_reference, tiny_gpt2_config

LR = 0.5
ROWS = 8  # the global batch; every layout below splits it into replicas and micro-batches
CONFIGS = {
    "GPT2LMHeadModel": {},
    "GPT2DoubleHeadsModel": {},
    "GPT2ForSequenceClassification": {"num_labels": 3},
    "GPT2ForTokenClassification": {"num_labels": 5, "classifier_dropout": 0.0},  # dropouts off: same math
    "GPT2ForQuestionAnswering": {},
}


def global_batch(head: str, length: int = 10) -> dict[str, torch.Tensor]:
    """Left-padded rows of very different lengths, so every micro-batch (and replica) holds a different
    number of label tokens; some labels -100 besides the padding."""
    generator = torch.Generator().manual_seed(7)
    input_ids = torch.randint(3, 1001, (ROWS, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    for row, padding in enumerate([0, 7, 3, 0, 8, 1, 5, 2]):
        attention_mask[row, :padding] = 0
        input_ids[row, :padding] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[3, 4:7] = -100
    batch = dict(input_ids=input_ids, attention_mask=attention_mask)
    if head == "GPT2LMHeadModel":
        return dict(batch, labels=labels)
    if head == "GPT2DoubleHeadsModel":  # two choices per row; trains on the language-modeling loss
        choices = input_ids.view(ROWS, 1, length).expand(ROWS, 2, length).contiguous()
        return dict(input_ids=choices, mc_token_ids=torch.full((ROWS, 2), length - 1),
                    labels=labels.view(ROWS, 1, length).expand(ROWS, 2, length).contiguous())
    if head == "GPT2ForSequenceClassification":
        return dict(batch, labels=torch.tensor([0, 2, -100, 1, 1, -100, -100, 0]))
    if head == "GPT2ForTokenClassification":
        return dict(batch, labels=labels.clamp(-100, 4))
    # Answers outside the input (12, 40) are ignored, as transformers ignores them.
    return dict(batch, start_positions=torch.tensor([1, 12, 7, 2, 9, 3, 40, 4]),
                end_positions=torch.tensor([3, 40, 7, 5, 9, 12, 8, 6]))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    paths = {}
    for head, overrides in CONFIGS.items():
        path = tmp_path_factory.mktemp(head)
        save_reference(getattr(transformers, head), tiny_gpt2_config(n_layer=4, **overrides), path)
        paths[head] = str(path)
    return paths


def reference_step(path: str, head: str) -> dict[str, torch.Tensor]:
    """One SGD step of transformers' model on the whole global batch, in one process."""
    model = getattr(transformers, head).from_pretrained(path).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model(**global_batch(head)).loss.backward()
    optimizer.step()
    return {name: param.detach() for name, param in model.named_parameters()}


def _manual_loop(rank, world_size, path, head, tp, pp, micro_batch_size, wrap):
    """The manual's loop, unchanged: data sharded over the data-parallel group, the model (or its DDP
    wrapper) called on the replica's rows, each micro-batch's loss backpropagated as it is."""
    model = getattr(oslo, head).from_pretrained_with_parallel(
        path, tensor_parallel_size=tp, pipeline_parallel_size=pp, micro_batch_size=micro_batch_size
    ).train()
    mpu = model.mpu
    model_ddp = model
    if wrap:
        model_ddp = DistributedDataParallel(model.gpu_modules(), process_group=mpu.get_data_parallel_group())
    optimizer = torch.optim.SGD(model.gpu_parameters(), lr=LR)
    rows = ROWS // mpu.get_data_parallel_world_size()
    start = mpu.get_data_parallel_rank() * rows
    sample = {name: value[start : start + rows] for name, value in global_batch(head).items()}

    optimizer.zero_grad()
    losses = []
    if pp == 1:
        output = model_ddp(**sample)
        losses.append(output.loss.detach())
        output.loss.backward()
    else:
        for micro_output in model_ddp(**sample):
            losses.append(micro_output.loss.detach())
            micro_output.loss.backward()
    optimizer.step()
    return full_params(model), losses, sample


def check_layout(path, head, tp, pp, dp, micro_batch_size, wrap=False):
    results = run_distributed(_manual_loop, tp * pp * dp, path, head, tp, pp, micro_batch_size, wrap)
    expected = reference_step(path, head)
    reference = getattr(transformers, head).from_pretrained(path)
    seen = set()
    for params, losses, sample in results:
        for name, value in params.items():
            source = "transformer.wte.weight" if name == "lm_head.weight" else name  # tied in transformers
            torch.testing.assert_close(value, expected[source], msg=lambda m, n=name: f"{head} {n}: {m}")
            seen.add(source)
        # The loss each rank reports is its own (micro-)batch's, as transformers computes it.
        micro = micro_batch_size if pp > 1 else ROWS // dp
        with torch.no_grad():
            own = [reference(**{k: v[i : i + micro] for k, v in sample.items()}).loss
                   for i in range(0, ROWS // dp, micro)]
        torch.testing.assert_close(torch.stack(losses), torch.stack(own))
    assert seen == set(expected), sorted(set(expected) - seen)


@pytest.mark.parametrize(
    "tp, pp, dp, micro_batch_size",
    [(1, 2, 1, 2), (2, 2, 1, 4), (1, 2, 2, 2), (1, 4, 1, 1), (2, 1, 2, 4), (1, 1, 2, 4)],
    ids=["tp1-pp2-dp1", "tp2-pp2-dp1", "tp1-pp2-dp2", "tp1-pp4-dp1", "tp2-pp1-dp2-ddp", "tp1-pp1-dp2-ddp"],
)
def test_lm_head_manual_loop_equals_one_process(checkpoints, tp, pp, dp, micro_batch_size):
    check_layout(checkpoints["GPT2LMHeadModel"], "GPT2LMHeadModel", tp, pp, dp, micro_batch_size, wrap=dp > 1)


@pytest.mark.parametrize("head", [h for h in CONFIGS if h != "GPT2LMHeadModel"])
@pytest.mark.parametrize("tp, pp, dp", [(2, 2, 1), (1, 2, 2)], ids=["tp2-pp2", "pp2-dp2"])
def test_every_head_manual_loop_equals_one_process(checkpoints, head, tp, pp, dp):
    check_layout(checkpoints[head], head, tp, pp, dp, 2)


def test_pipeline_manual_loop_with_ddp_wrapper_equals_one_process(checkpoints):
    """The manual writes `for micro_output in model_ddp(...)` with pipelines too."""
    check_layout(checkpoints["GPT2LMHeadModel"], "GPT2LMHeadModel", 1, 2, 2, 2, wrap=True)


def test_classification_heads_at_pp1_with_ddp(checkpoints):
    """Sequence classification's labelled rows (-100 rows ignored) differ across the replicas."""
    check_layout(checkpoints["GPT2ForSequenceClassification"], "GPT2ForSequenceClassification", 1, 1, 2, 4,
                 wrap=True)


def _num_items(rank, world_size, path):
    """`num_items_in_batch` (transformers' Trainer passes it) divides the sums instead, as transformers does."""
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(
        path, pipeline_parallel_size=2, micro_batch_size=4
    ).train()
    batch = global_batch("GPT2LMHeadModel")
    losses = [out.loss.detach() for out in model(**batch, num_items_in_batch=100) if out.loss.backward() is None]
    reference = transformers.GPT2LMHeadModel.from_pretrained(path).train()
    expected = [reference(**{k: v[i : i + 4] for k, v in batch.items()}, num_items_in_batch=100).loss
                for i in (0, 4)]
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected).detach())
    sum(expected).backward()
    theirs = {n: p.grad for n, p in reference.named_parameters()}
    for name, grad in full_grads(model).items():
        source = "transformer.wte.weight" if name == "lm_head.weight" else name
        torch.testing.assert_close(grad, theirs[source], msg=name)


def test_num_items_in_batch_is_honoured(checkpoints):
    run_distributed(_num_items, 2, checkpoints["GPT2LMHeadModel"])


def _logits_by_default(rank, world_size, path):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=2).train()
    reference = transformers.GPT2LMHeadModel.from_pretrained(path).train()
    batch = global_batch("GPT2LMHeadModel")
    expected = reference(**batch)
    trained = model(**batch)  # a training call: the loss, no all-gather of the logits
    torch.testing.assert_close(trained.loss, expected.loss)
    assert "logits" not in trained and trained[0] is trained.loss and len(trained.to_tuple()) == 2  # + the cache
    with pytest.raises(AttributeError, match="logits were not gathered.*Pass gather_logits=True"):
        trained.logits  # noqa: B018
    assert "logits=" not in repr(trained)
    torch.testing.assert_close(model(**batch, gather_logits=True).logits, expected.logits)
    assert model(**batch, gather_logits=False).logits is None
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, expected.logits)  # evaluation as before
    unlabelled = {k: v for k, v in batch.items() if k != "labels"}
    torch.testing.assert_close(model(**unlabelled).logits, expected.logits)  # no labels
    torch.testing.assert_close(model.eval()(**batch).logits, expected.logits)  # eval mode
    doubled = oslo.GPT2DoubleHeadsModel.from_pretrained_with_parallel(path, tensor_parallel_size=2).train()
    choices = global_batch("GPT2DoubleHeadsModel")
    with pytest.raises(AttributeError, match="gather_logits=True"):
        doubled(**choices).logits  # noqa: B018


def test_training_call_skips_the_logits_gather_and_says_so(checkpoints):
    run_distributed(_logits_by_default, 2, checkpoints["GPT2LMHeadModel"])


def _ddp_over_the_world(rank, world_size, path):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=2).train()
    wrong = DistributedDataParallel(model.gpu_modules())  # the default group: both tensor-parallel ranks
    with pytest.raises(ValueError, match=r"over ranks \[0, 1\], but this rank's data-parallel replicas are ranks "
                                         rf"\[{rank}\].*process_group=model.mpu.get_data_parallel_group"):
        wrong(**global_batch("GPT2LMHeadModel"))


def test_ddp_over_another_group_than_the_data_parallel_one_is_refused(checkpoints):
    run_distributed(_ddp_over_the_world, 2, checkpoints["GPT2LMHeadModel"])
