"""The deployment launcher (oslo/deployment.py): a model split over worker processes, driven from plain python.

One deployed GPT2 (tp 2 x pp 2) serves most tests; the other architectures, failures and the example
server start their own. Workers start with the forkserver method (one import of torch per test session);
the parent-death test runs a script with the spawn method.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import transformers

import oslo
import oslo.deployment as deployment
from oslo.launch import free_port
from tests.distributed import run_distributed
from tests.helpers import save_reference, tiny_gpt2_config
from tests.models.zoo import all_cases, compare_outputs

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parent.parent


def _gone(pid: int) -> bool:
    """The process has ended (a zombie counts: it runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):  # (gone before the open, or between the open and the read)
        return True


def _wait_gone(pids, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if all(_gone(pid) for pid in pids):
            return True
        time.sleep(0.1)
    return False


def _torch_shm_files() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("torch_")}


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("deployment") / "tiny-gpt2"
    reference = save_reference(transformers.GPT2LMHeadModel, tiny_gpt2_config(), directory)
    return str(directory), reference


@pytest.fixture(scope="module")
def gpt2(gpt2_dir):
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(
        gpt2_dir[0], tensor_parallel_size=2, pipeline_parallel_size=2, deployment=True)
    yield model
    model.close()


def test_gpt2_tp2_pp2_behaves_like_the_model(gpt2, gpt2_dir, tmp_path):
    reference = gpt2_dir[1]
    assert isinstance(gpt2, deployment.DeployedModel) and len(gpt2.worker_pids) == 4
    assert gpt2.config.n_layer == 2 and gpt2.can_generate() and not gpt2.training
    assert gpt2.generation_config.eos_token_id == 2
    ids = torch.randint(3, 1001, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids, labels=ids)
    output = gpt2(ids, labels=ids)  # one output, not a micro-batch loop, under pipelines
    assert type(output) is type(expected)
    compare_outputs(output, expected, "GPT2LMHeadModel")
    assert not output.logits.is_shared()  # ordinary memory in the parent
    assert output.past_key_values is None  # the KV cache stays with the workers
    compare_outputs(gpt2.forward(input_ids=ids), reference(ids), "forward")

    options = dict(max_new_tokens=6, num_beams=5, no_repeat_ngram_size=4, pad_token_id=0)
    assert torch.equal(gpt2.generate(ids, **options), reference.generate(ids, **options))
    assert gpt2.fuse() is gpt2
    assert torch.equal(gpt2.generate(ids, **options), reference.generate(ids, **options))
    assert gpt2.train() is gpt2 and gpt2.training
    assert gpt2.eval() is gpt2 and not gpt2.training
    assert gpt2.micro_batch_size == 1  # other attributes are read from the workers

    gpt2.save_pretrained_with_parallel(tmp_path / "merged", save_with_merging=True)
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(reloaded(ids).logits, expected.logits)
    gpt2.save_pretrained(tmp_path / "saved")  # transformers' method, from the one caller: the same plain files
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "saved")
    torch.testing.assert_close(reloaded(ids).logits, expected.logits)


def test_resize_token_embeddings_reaches_the_workers(gpt2_dir, tmp_path):
    """Every worker resizes (their rank 0's draws: tests/models/test_resize.py checks those against transformers'),
    the caller's config follows, and the merged checkpoint holds the old rows and the new size."""
    directory, reference = gpt2_dir
    with oslo.GPT2LMHeadModel.from_pretrained_with_parallel(directory, tensor_parallel_size=2,
                                                            deployment=True) as model:
        assert model.resize_token_embeddings(1005, pad_to_multiple_of=8) is None
        assert model.config.vocab_size == 1008
        ids = torch.tensor([[1007, 5, 1001]])
        assert model(ids).logits.shape == (1, 3, 1008)
        model.save_pretrained_with_parallel(tmp_path, save_with_merging=True)
    saved = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    assert saved.config.vocab_size == 1008
    torch.testing.assert_close(saved.transformer.wte.weight[:1001], reference.transformer.wte.weight,
                               rtol=0, atol=0)


def test_every_listener_is_on_loopback(gpt2):
    ss = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True)
    if ss.returncode != 0:
        pytest.skip("no ss")
    pids = set(gpt2.worker_pids)
    mine = [line for line in ss.stdout.splitlines() if any(int(p) in pids for p in re.findall(r"pid=(\d+)", line))]
    assert mine, ss.stdout  # the rendezvous store and gloo listen...
    for line in mine:  # ...on loopback only
        assert line.split()[3].rsplit(":", 1)[0] in ("127.0.0.1", "[::1]"), line


def test_concurrent_threads_are_serialized(gpt2, gpt2_dir):
    reference = gpt2_dir[1]
    prompts = [torch.randint(3, 1001, (1, 3 + i % 5), generator=torch.Generator().manual_seed(i)) for i in range(8)]
    expected = [reference.generate(p, max_new_tokens=3, pad_token_id=0) for p in prompts]

    def ask(i):
        return torch.equal(gpt2.generate(prompts[i % 8], max_new_tokens=3, pad_token_id=0), expected[i % 8])

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(ask, range(32)))


def test_worker_error_reaches_the_caller_and_the_pool_stays_usable(gpt2):
    start = time.monotonic()
    with pytest.raises(IndexError) as raised:
        gpt2(torch.tensor([[5, 6, 5000]]))  # outside the vocabulary: oslo raises on every rank
    assert time.monotonic() - start < 10
    notes = "".join(getattr(raised.value, "__notes__", []))
    assert "deployment worker rank" in notes and "Traceback" in notes
    assert gpt2(torch.tensor([[5, 6, 7]])).logits.shape == (1, 3, 1001)


def test_too_little_shared_memory_is_a_clear_error(gpt2, monkeypatch):
    monkeypatch.setattr(deployment, "shm_free_bytes", lambda: 64 * 2**20)  # Docker's default /dev/shm
    big = torch.zeros(1, 10_000_000, dtype=torch.long)  # 80 MB
    with pytest.raises(deployment.SharedMemoryTooSmallError, match=r"--shm-size.*--ipc=host"):
        gpt2(big)
    monkeypatch.undo()
    assert gpt2(torch.tensor([[5, 6, 7]])).logits.shape == (1, 3, 1001)


@pytest.mark.parametrize("name,tp,pp", [("GPTNeoForCausalLM", 2, 1), ("BertForMaskedLM", 2, 1),
                                        ("T5ForConditionalGeneration", 1, 2)])
def test_architectures(name, tp, pp, tmp_path):
    case = next(case for case in all_cases() if case.name == name and not case.variant)
    torch.manual_seed(0)
    reference = getattr(transformers, name)(case.config()).eval()
    reference.save_pretrained(tmp_path / name)
    batch = case.batch()
    with getattr(oslo, name).from_pretrained_with_parallel(
            tmp_path / name, tensor_parallel_size=tp, pipeline_parallel_size=pp, deployment=True) as model:
        with torch.no_grad():
            expected = reference(**batch)
        compare_outputs(model(**batch), expected, name)
        if case.generate:
            inputs = {key: value for key, value in batch.items() if key in ("input_ids", "attention_mask")}
            options = dict(max_new_tokens=4, num_beams=2, pad_token_id=case.config().pad_token_id or 0)
            assert torch.equal(model.generate(**inputs, **options), reference.generate(**inputs, **options))


def test_from_config_context_manager_and_killed_worker():
    config = tiny_gpt2_config()
    with oslo.GPT2LMHeadModel.from_config_with_parallel(config, tensor_parallel_size=2, seed=0,
                                                          deployment=True) as model:
        pids = model.worker_pids
        assert model(torch.tensor([[5, 6]])).logits.shape == (1, 2, 1001)
        os.kill(pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 1 .*SIGKILL"):
            model(torch.tensor([[5, 6]]))
        assert time.monotonic() - start < 10
        assert _wait_gone(pids, 10)  # the rest were shut down
        with pytest.raises(RuntimeError, match="closed"):
            model(torch.tensor([[5, 6]]))
    with oslo.GPT2LMHeadModel.from_config_with_parallel(config, deployment=True) as model:
        pids = model.worker_pids
    assert model.closed and _wait_gone(pids, 10)


def test_worker_killed_during_a_call():
    with oslo.GPT2LMHeadModel.from_config_with_parallel(tiny_gpt2_config(), tensor_parallel_size=2,
                                                          deployment=True) as model:
        pids = model.worker_pids
        raised, killed_at = [], []

        def busy():
            try:
                while True:
                    model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=50, pad_token_id=0)
            except Exception as exc:  # noqa: BLE001
                raised.append((exc, time.monotonic()))

        thread = threading.Thread(target=busy)
        thread.start()
        time.sleep(0.5)
        killed_at.append(time.monotonic())
        os.kill(pids[0], signal.SIGKILL)
        thread.join(timeout=30)
        assert raised, "the call did not return"
        exc, at = raised[0]
        assert isinstance(exc, RuntimeError) and re.search(r"rank 0 .*SIGKILL", str(exc)), exc
        assert at - killed_at[0] < 10
        assert _wait_gone(pids, 10)


def test_interrupted_call_never_leaves_the_workers_out_of_step(gpt2_dir):
    reference = gpt2_dir[1]
    prompt = torch.tensor([[5, 6, 7]])
    expected = reference.generate(prompt, max_new_tokens=3, pad_token_id=0)
    with oslo.GPT2LMHeadModel.from_pretrained_with_parallel(gpt2_dir[0], tensor_parallel_size=2,
                                                            deployment=True) as model:
        pids = model.worker_pids
        timer = threading.Timer(0.5, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            while True:  # Ctrl-C arrives in the middle of a call (almost always: the caller mostly waits)
                model.generate(prompt, max_new_tokens=40, pad_token_id=0)
        timer.join()
        if model.closed:  # interrupted while waiting for the workers: they were shut down
            assert _wait_gone(pids, 10)
        else:  # interrupted between calls: the next call gets its own answer
            assert torch.equal(model.generate(prompt, max_new_tokens=3, pad_token_id=0), expected)


def test_startup_error_has_the_workers_exception_type(tmp_path):
    with pytest.raises(Exception) as in_process:
        oslo.GPT2LMHeadModel.from_pretrained_with_parallel(str(tmp_path / "missing"))
    start = time.monotonic()
    with pytest.raises(type(in_process.value)):
        oslo.GPT2LMHeadModel.from_pretrained_with_parallel(str(tmp_path / "missing"), tensor_parallel_size=2,
                                                           deployment=True)
    assert time.monotonic() - start < 30


def _under_launcher(rank, world_size, directory):
    try:
        oslo.GPT2LMHeadModel.from_pretrained_with_parallel(directory, tensor_parallel_size=2, deployment=True)
    except ValueError as exc:
        return str(exc)
    return None


def test_refused_under_a_launcher(gpt2_dir):
    messages = run_distributed(_under_launcher, 2, gpt2_dir[0], timeout=60)
    assert all(message and "Drop deployment=True" in message for message in messages), messages


def _deploy_in_a_forked_child(rank, world_size, directory):
    os.environ.pop("RANK", None)  # a plain process forked from this one, not a launcher's rank
    os.environ.pop("WORLD_SIZE", None)
    with oslo.GPT2LMHeadModel.from_pretrained_with_parallel(directory, tensor_parallel_size=2,
                                                            deployment=True) as model:
        return model(torch.tensor([[5, 6, 7]])).logits


def test_a_process_forked_after_a_deployment_deploys_its_own(gpt2, gpt2_dir):
    """The fork server of the parent (started by ``gpt2``) is not the child's: the child starts its own."""
    gpt2(torch.tensor([[5, 6, 7]]))  # the parent's fork server is running
    logits = run_distributed(_deploy_in_a_forked_child, 1, gpt2_dir[0], timeout=120)[0]
    torch.testing.assert_close(logits, gpt2_dir[1](torch.tensor([[5, 6, 7]])).logits)


PARENT_SCRIPT = """
import sys
import torch
import oslo
import oslo.deployment

if __name__ == "__main__":
    oslo.deployment.START_METHOD = sys.argv[2]
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(sys.argv[1], tensor_parallel_size=2, deployment=True)
    ids = torch.randint(3, 1000, (2, 16))
    model(ids)
    print(" ".join(map(str, model.worker_pids)), flush=True)
    while True:
        model.generate(ids, max_new_tokens=20, pad_token_id=0)
"""


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_parent_killed_workers_exit_and_leave_no_shared_memory(gpt2_dir, tmp_path, start_method):
    script = tmp_path / "app.py"
    script.write_text(PARENT_SCRIPT)
    before = _torch_shm_files()
    parent = subprocess.Popen([sys.executable, str(script), gpt2_dir[0], start_method], stdout=subprocess.PIPE,
                              text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        line = parent.stdout.readline()  # the pytest timeout bounds this
        pids = [int(pid) for pid in line.split()]
        assert len(pids) == 2, line
        time.sleep(0.5)  # in the middle of generate() calls
        parent.kill()
        parent.wait(timeout=10)
        assert _wait_gone(pids, 10), [pid for pid in pids if not _gone(pid)]
    finally:
        parent.kill()
    left = {name for name in _torch_shm_files() - before if any(f"_{pid}_" in name for pid in [parent.pid, *pids])}
    assert not left


def _post(port: int, body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


@pytest.mark.timeout(180)
def test_example_server_answers_concurrent_requests(gpt2_dir):
    directory, reference = gpt2_dir
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "deployment_server.py"), directory, "--tensor-parallel-size", "2",
         "--port", str(port)], env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.stderr.read()
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
                break
            except OSError:
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.5)
        prompts = [torch.randint(3, 1001, (1 + i % 3,), generator=torch.Generator().manual_seed(i)).tolist()
                   for i in range(16)]
        expected = [reference.generate(torch.tensor([p]), max_new_tokens=2, pad_token_id=0).tolist()
                    for p in prompts]

        def ask(i):
            try:
                answer = _post(port, {"input_ids": prompts[i % 16], "max_new_tokens": 2})
            except Exception as exc:  # noqa: BLE001 - counted as lost
                return "lost", repr(exc)
            return ("right" if answer["output_ids"] == expected[i % 16] else "wrong"), answer

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(ask, range(200)))
        counts = {kind: sum(1 for k, _ in results if k == kind) for kind in ("right", "wrong", "lost")}
        assert counts == {"right": 200, "wrong": 0, "lost": 0}, [r for r in results if r[0] != "right"][:3]
        # the client's errors: ids outside the vocabulary, text without tokenizer files, no ids
        for body, reason in (({"input_ids": [5, 5000]}, "outside the vocabulary"),
                             ({"text": "hello"}, "no tokenizer"), ({"input_ids": []}, "non-empty")):
            with pytest.raises(urllib.error.HTTPError) as bad:
                _post(port, body)
            assert bad.value.code == 400 and reason in json.loads(bad.value.read())["error"]
        assert _post(port, {"input_ids": prompts[0], "max_new_tokens": 2})["output_ids"] == expected[0]
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()



def _example_server_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("deployment_server", ROOT / "examples" / "deployment_server.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _word_tokenizer(directory):
    """A tokenizer of 26 words ("a" is id 3 ... "z" is 28) saved in ``directory``, as a checkpoint's would be."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{chr(ord("a") + i): 3 + i for i in range(26)}, "<unk>": 29}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>",
                                                     eos_token="</s>")
    tokenizer.save_pretrained(directory)


def _raw_post(port: int, data: bytes, content_type: str = "application/json") -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=data,
                                     headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.fixture(scope="module")
def example_servers(gpt2_dir, tmp_path_factory):
    """The example's app over real HTTP on 127.0.0.1, in this process, on a tp=1 model (create_app needs only
    generate() and the config): one server without a tokenizer (the checkpoint has no tokenizer files), one with."""
    from werkzeug.serving import make_server

    server_module = _example_server_module()
    with_tokenizer = tmp_path_factory.mktemp("with-tokenizer")
    _word_tokenizer(with_tokenizer)
    model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(gpt2_dir[0])
    tokenizers = [server_module.load_tokenizer(gpt2_dir[0]), server_module.load_tokenizer(str(with_tokenizer))]
    assert tokenizers[0] is None and tokenizers[1] is not None  # AutoTokenizer's empty tokenizer is refused
    servers = [make_server("127.0.0.1", 0, server_module.create_app(model, tokenizer), threaded=True)
               for tokenizer in tokenizers]
    threads = [threading.Thread(target=server.serve_forever, daemon=True) for server in servers]
    for thread in threads:
        thread.start()
    yield [server.server_port for server in servers]
    for server in servers:
        server.shutdown()


@pytest.mark.parametrize("body, reason", [
    (b"not json", "the body must be a JSON object"),
    (b"", "the body must be a JSON object"),
    (b"[5, 6, 7]", "the body must be a JSON object"),
    (b'"input_ids"', "the body must be a JSON object"),
    (b"{}", "send input_ids (a list of token ids)"),
    (b'{"text": "a b c"}', "this server has no tokenizer"),
    (b'{"input_ids": [5], "text": "a"}', "not both"),
    (b'{"input_ids": []}', "input_ids must be a non-empty list"),
    (b'{"input_ids": [[]]}', "input_ids must be a non-empty list"),
    (b'{"input_ids": "5 6 7"}', "input_ids must be a non-empty list"),
    (b'{"input_ids": [5, "6"]}', "input_ids must hold integer token ids, got '6'"),
    (b'{"input_ids": [5, 6.5]}', "got 6.5"),
    (b'{"input_ids": [5, true]}', "got True"),
    (b'{"input_ids": [[5, 6], [7]]}', "different lengths [2, 1]"),
    (b'{"input_ids": [5, 5000]}', "input_ids hold 5000, outside the vocabulary [0, 1001)"),
    (b'{"input_ids": [5, -1]}', "input_ids hold -1, outside the vocabulary"),
    (b'{"input_ids": [5], "max_new_tokens": 0}', "max_new_tokens must be an integer >= 1, got 0"),
    (b'{"input_ids": [5], "max_new_tokens": "8"}', "max_new_tokens must be an integer >= 1, got '8'"),
    (b'{"input_ids": [5], "max_new_tokens": 2.5}', "got 2.5"),
    (b'{"input_ids": [5], "max_new_tokens": 100}', "exceed the 64 positions"),
    (b'{"input_ids": [5], "top_p": 2}', "top_p must be a number in (0, 1]"),
    (b'{"input_ids": [5], "do_sample": "yes"}', "do_sample must be true or false"),
    (b'{"input_ids": [5], "max_tokens": 4}', "unknown field(s) ['max_tokens']"),
])
def test_example_server_answers_400_with_the_reason(example_servers, body, reason):
    status, answer = _raw_post(example_servers[0], body)
    assert status == 400 and reason in answer["error"], (status, answer)


def test_example_server_with_a_tokenizer(example_servers, gpt2_dir):
    status, answer = _raw_post(example_servers[1], b'{"text": "a b c", "max_new_tokens": 2}')
    expected = gpt2_dir[1].generate(torch.tensor([[3, 4, 5]]), max_new_tokens=2, pad_token_id=0)
    assert status == 200 and answer["output_ids"] == expected.tolist(), answer
    for body, reason in ((b'{"text": ""}', "text must be a non-empty string"),
                         (b'{"text": ["a"]}', "text must be a non-empty string"),
                         (b'{"text": "   "}', "encodes to no tokens"),
                         (b"{}", "send input_ids (a list of token ids) or text (a string)")):
        status, answer = _raw_post(example_servers[1], body)
        assert status == 400 and reason in answer["error"], (body, status, answer)
    status, answer = _raw_post(example_servers[0], b'{"input_ids": [5, 6], "max_new_tokens": 2}')
    assert status == 200 and answer["output_ids"] == gpt2_dir[1].generate(
        torch.tensor([[5, 6]]), max_new_tokens=2, pad_token_id=0).tolist()


STDIN_SCRIPT = """
import oslo
from tests.helpers import tiny_gpt2_config

oslo.GPT2LMHeadModel.from_config_with_parallel(tiny_gpt2_config(), tensor_parallel_size=2, deployment=True)
"""


def test_a_script_read_from_stdin_names_the_cause(tmp_path):
    """``python - < script.py``: the workers would re-import ``<stdin>`` and fail with FileNotFoundError under a
    message about the ``__main__`` guard; the caller is told the cause instead, before any worker starts."""
    done = subprocess.run([sys.executable, "-"], input=STDIN_SCRIPT, capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=100)
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: deployment=True starts its workers"), done.stderr
    for fragment in ("read from standard input (`python - < script.py`)", "imports the main module",
                     "Save the script to a file"):
        assert fragment in last, last
    assert "deployment worker rank" not in done.stderr  # no worker was started


def test_a_main_module_whose_file_is_gone_is_refused(tmp_path, monkeypatch):
    import types

    main = types.ModuleType("__main__")
    main.__file__ = str(tmp_path / "deleted.py")
    monkeypatch.setitem(sys.modules, "__main__", main)
    with pytest.raises(RuntimeError, match=r"run from the file '.*deleted.py', which no longer exists"):
        oslo.GPT2LMHeadModel.from_config_with_parallel(tiny_gpt2_config(), tensor_parallel_size=2, deployment=True)
