import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LogitsProcessorList
from transformers.generation.logits_process import (
    NoRepeatNGramLogitsProcessor,
    _get_generated_ngrams,
    _get_ngrams,
)

from oslo.kernels import (
    FusedNoRepeatNGramLogitsProcessor,
    no_repeat_ngram_block,
    no_repeat_ngram_block_reference,
)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

# History lengths around n (shorter than n, exactly n - 1, n, ...) and longer ones; a token alphabet
# small enough that n-grams repeat often; odd vocabularies.
LENGTHS = [0, 1, 2, 3, 4, 5, 9, 40]


def _history(rows, cur_len, alphabet, seed):
    return torch.randint(0, alphabet, (rows, cur_len), generator=torch.Generator().manual_seed(seed))


def _scores(rows, vocab, seed, device="cpu"):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)).to(device)


def _legacy_bans(input_ids, ngram_size):
    """transformers <= 4.x's per-hypothesis dictionary algorithm, still shipped as helpers."""
    rows, cur_len = input_ids.shape
    if cur_len + 1 < ngram_size:
        return [[] for _ in range(rows)]
    ngrams = _get_ngrams(ngram_size, input_ids, rows)
    return [_get_generated_ngrams(ngrams[row], input_ids[row], ngram_size, cur_len) for row in range(rows)]


# On CPU tensors no_repeat_ngram_block runs the NumPy path; the reference is the torch path other
# devices run (and the Triton tests' oracle): both are checked against transformers.
IMPLEMENTATIONS = {"numpy (cpu)": no_repeat_ngram_block, "torch": no_repeat_ngram_block_reference}


@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("ngram_size", [1, 2, 3, 4])
@pytest.mark.parametrize("cur_len", LENGTHS)
@pytest.mark.parametrize("vocab, alphabet", [(11, 3), (50257, 5), (997, 997)])
def test_bans_exactly_what_transformers_bans(implementation, ngram_size, cur_len, vocab, alphabet):
    rows = 6
    input_ids = _history(rows, cur_len, alphabet, seed=cur_len * 10 + ngram_size)
    scores = _scores(rows, vocab, seed=1)
    out = IMPLEMENTATIONS[implementation](input_ids, scores, ngram_size)
    expected = NoRepeatNGramLogitsProcessor(ngram_size)(input_ids, scores)
    assert torch.equal(out, expected)

    legacy = scores.clone()
    for row, tokens in enumerate(_legacy_bans(input_ids, ngram_size)):
        legacy[row, tokens] = float("-inf")
    assert torch.equal(out, legacy)


@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
def test_ids_outside_the_vocab_ban_nothing(implementation):
    """An embedding larger than the LM head: such ids cannot be generated, transformers ignores them."""
    input_ids = torch.tensor([[5, 12, 5, 12, 5], [5, 3, 5, 3, 5]])
    scores = _scores(2, 10, seed=0)
    out = IMPLEMENTATIONS[implementation](input_ids, scores, 2)
    # Written out rather than asked of transformers: its processor indexes out of range there in 5.17.
    expected = scores.clone()
    expected[1, 3] = float("-inf")  # row 1 bans 3 (after 5 comes 3); row 0 would ban 12, outside the vocab
    assert torch.equal(out, expected)


def test_inplace_and_copy_semantics():
    input_ids = torch.tensor([[1, 2, 1]])
    scores = _scores(1, 5, seed=0)
    original = scores.clone()
    out = no_repeat_ngram_block(input_ids, scores, 2)
    assert torch.equal(scores, original) and out.data_ptr() != scores.data_ptr()
    assert out[0, 2] == float("-inf")
    same = no_repeat_ngram_block(input_ids, scores, 2, inplace=True)
    assert same is scores and scores[0, 2] == float("-inf")
    assert torch.equal(no_repeat_ngram_block_reference(input_ids, original, 2), out)


@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
def test_non_contiguous_history(implementation):
    input_ids = _history(8, 30, 4, seed=3)[::2, 1:]
    scores = _scores(4, 13, seed=2)
    assert torch.equal(
        IMPLEMENTATIONS[implementation](input_ids, scores, 3), NoRepeatNGramLogitsProcessor(3)(input_ids, scores)
    )


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
def test_narrow_integer_history(dtype):
    """Token ids in a narrow dtype: banned ids index scores as ids, never as a boolean mask."""
    input_ids = _history(4, 25, 3, seed=5).to(dtype)
    scores = _scores(4, 7, seed=3)
    expected = NoRepeatNGramLogitsProcessor(2)(input_ids.long(), scores)
    assert torch.equal(no_repeat_ngram_block(input_ids, scores, 2), expected)
    assert torch.equal(no_repeat_ngram_block(input_ids, scores.half(), 2), expected.half())


@pytest.mark.parametrize("ngram_size", [0, -1, True, 2.0, None])
def test_bad_ngram_size_is_refused(ngram_size):
    with pytest.raises(ValueError, match="is not a positive integer"):
        FusedNoRepeatNGramLogitsProcessor(ngram_size)
    with pytest.raises(ValueError, match="is not a positive integer"):
        no_repeat_ngram_block(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 4), ngram_size)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match=r"input_ids \(2, 3\) and scores \(3, 4\)"):
        no_repeat_ngram_block(torch.zeros(2, 3, dtype=torch.long), torch.zeros(3, 4), 2)
    with pytest.raises(ValueError, match="not an integer dtype"):
        no_repeat_ngram_block(torch.zeros(2, 3), torch.zeros(2, 4), 2)


@pytest.fixture(scope="module")
def tiny_gpt2():
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=37,
        n_positions=64,
        n_embd=16,
        n_layer=1,
        n_head=2,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return GPT2LMHeadModel(config).eval()


@pytest.mark.parametrize("num_beams", [1, 3])
@pytest.mark.parametrize("inplace", [False, True])
def test_processor_in_generate_matches_no_repeat_ngram_size(tiny_gpt2, num_beams, inplace):
    prompt = torch.tensor([[3, 4, 3, 4, 5], [7, 7, 7, 8, 9]])
    common = {"max_new_tokens": 24, "do_sample": False, "num_beams": num_beams, "pad_token_id": 0}
    expected = tiny_gpt2.generate(prompt, no_repeat_ngram_size=2, **common)
    processors = LogitsProcessorList([FusedNoRepeatNGramLogitsProcessor(2, inplace=inplace)])
    out = tiny_gpt2.generate(prompt, logits_processor=processors, **common)
    assert torch.equal(out, expected)
    unblocked = tiny_gpt2.generate(prompt, **common)
    assert not torch.equal(unblocked, expected)  # the blocking actually changed something


# ----------------------------------------------------------------------------- Triton


@pytest.mark.triton
@pytest.mark.parametrize("ngram_size", [1, 2, 3, 4])
@pytest.mark.parametrize("cur_len", [0, 2, 3, 300])
def test_triton_matches_reference(triton_device, ngram_size, cur_len):
    """300 tokens: two window blocks per row; a vocabulary of 1009 (odd, prime)."""
    input_ids = _history(5, cur_len, 4, seed=ngram_size).to(triton_device)
    scores = _scores(5, 1009, seed=0, device=triton_device)
    out = no_repeat_ngram_block(input_ids, scores, ngram_size)
    expected = no_repeat_ngram_block_reference(input_ids, scores, ngram_size)
    assert torch.equal(out, expected)
    assert torch.equal(out.cpu(), NoRepeatNGramLogitsProcessor(ngram_size)(input_ids.cpu(), scores.cpu()))


@pytest.mark.triton
def test_triton_strided_history_out_of_vocab_and_inplace(triton_device):
    input_ids = _history(6, 41, 3, seed=9)[::2, 1:].to(triton_device)  # non-contiguous
    input_ids[0, 5] = 2000  # beyond the 13-token vocabulary
    scores = _scores(3, 13, seed=4, device=triton_device).half()
    expected = no_repeat_ngram_block_reference(input_ids, scores, 3)
    out = no_repeat_ngram_block(input_ids, scores, 3, inplace=True)
    assert out is scores and torch.equal(out, expected)
    transposed = _scores(13, 3, seed=5, device=triton_device).t()  # strides (1, 3)
    expected = no_repeat_ngram_block_reference(input_ids, transposed, 3)
    assert torch.equal(no_repeat_ngram_block(input_ids, transposed, 3), expected)
