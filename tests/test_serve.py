"""`jaxrl-tools serve`: JetStream's gRPC client gets the tokens the engine generates, and with
`--tools` answers whose tool calls ran server-side in the sandbox.

A tiny random policy with the demo tokenizer (it has a chat template) is served on a free port;
JetStream's own stub sends token-id and text requests, and the answers must be the greedy
tokens of the same engine run directly on the same prompt (rendered through the chat template
for a text request). Several requests in a row also exercise slots freed and refilled.
"""

import signal
import socket
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest
import yaml
from fakes import TINY_RUN_MODEL, tiny_model_config

from jaxrl_tools import prompts, run
from jaxrl_tools.config_loader import load_config
from jaxrl_tools.tasks.tokenizer import build_tokenizer

N = 12  # tokens per request


@pytest.fixture(scope="module")
def run_yaml(tmp_path_factory):
    """A tiny run's config (random policy, the demo tokenizer, 64-token prompts)."""
    d = tmp_path_factory.mktemp("serve")
    build_tokenizer(d / "tok", vocab_size=300)
    path = d / "run.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": {"tiny": TINY_RUN_MODEL},
                "tokenizer": {"path": str(d / "tok"), "vocab_size": 300},
                "data": {"system_prompt": "Answer briefly."},
                "rollout": {"max_prompt_len": 64, "max_response_len": 32, "slots": 2},
                "trainer": {"checkpoint_dir": str(d / "ckpt"), "log_dir": str(d / "logs")},
            }
        )
    )
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(run_yaml):
    from jaxrl_tools.serve import jetstream_engine, start_server

    cfg = load_config(run_yaml, [])
    port = free_port()
    server = start_server(cfg, from_checkpoint=False, step=None, port=port)
    # The reference: the same policy (same seed) in an engine of its own, stepped directly.
    tokenizer = run.setup_tokenizer(cfg)
    model_cfg, params = run.setup_model(cfg, tokenizer)
    engine = jetstream_engine(cfg, model_cfg, params, tokenizer)
    yield port, engine, params, tokenizer
    server.stop()


def greedy(engine, params, ids: list[int]) -> list[int]:
    state = engine.init_decode_state()
    prefix = engine.prefill(params=params, padded_tokens=np.asarray(ids), true_length=len(ids))
    state = engine.insert(prefix, state, 0)
    out = []
    while len(out) < N:
        state, step = engine.generate_steps(params, state, 4)
        out += np.asarray(step.tokens)[0].tolist()
    return out[:N]


def decode(port: int, **content) -> list:
    """The samples JetStream's client gets for a text or token-id request (neither: none)."""
    import grpc
    from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = jetstream_pb2_grpc.OrchestratorStub(channel)
        what = {}
        if "text" in content:
            what = {"text_content": jetstream_pb2.DecodeRequest.TextContent(text=content["text"])}
        elif "token_ids" in content:
            ids = content["token_ids"]
            what = {"token_content": jetstream_pb2.DecodeRequest.TokenContent(token_ids=ids)}
        request = jetstream_pb2.DecodeRequest(max_tokens=N, **what)
        return [s for r in stub.Decode(request, timeout=120) for s in r.stream_content.samples]


def refused(port: int, **content) -> str:
    """The details of the INVALID_ARGUMENT a request gets (fails if it gets anything else)."""
    import grpc

    with pytest.raises(grpc.RpcError) as info:
        decode(port, **content)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    return info.value.details()


def stop_at_eos(tokens: list[int], engine) -> list[int]:
    for i, t in enumerate(tokens):
        if t in engine.eos_token_ids:
            return tokens[:i]
    return tokens


def test_token_requests_get_the_engines_greedy_tokens(served):
    port, engine, params, tokenizer = served
    for question in ("what is 2 + 3?", "name a prime", "what is 2 + 3?"):
        ids = prompts.encode_prompt(
            tokenizer, {"prompt": question}, None, "Answer briefly.", max_len=64
        )
        got = [t for s in decode(port, token_ids=ids) for t in s.token_ids]
        want = stop_at_eos(greedy(engine, params, ids), engine)
        assert len(want) == N and got == want


def test_text_requests_go_through_the_chat_template(served):
    port, engine, params, tokenizer = served
    question = "what is 2 + 3?"
    ids = prompts.encode_prompt(tokenizer, {"prompt": question}, None, "Answer briefly.")
    want = stop_at_eos(greedy(engine, params, ids), engine)
    text = "".join(s.text for s in decode(port, text=question))
    assert len(want) == N and text == tokenizer.decode(want)
    # Not the raw text: tokenized as it is, the question gives other tokens (a random model
    # mostly repeats the prompt's last token: the template's newline, or the question mark).
    raw = tokenizer.encode(question, add_special_tokens=False)
    assert stop_at_eos(greedy(engine, params, raw), engine) != want


def test_tools_run_server_side_in_the_sandbox(tmp_path):
    # The ReTool recipe of tests/test_train_e2e.py: a tiny policy scripted (logits hook) to call
    # the Python tool on "6*7" and then answer; the real sandbox runs the call.
    import grpc
    from test_train_e2e import RECORDS, _config, scripted_engine

    from jaxrl_tools import models
    from jaxrl_tools.rollout import Sampler
    from jaxrl_tools.serve import ToolServer, tool_servicer
    from jaxrl_tools.tools import ToolExecutor

    tok = build_tokenizer(tmp_path / "tok", vocab_size=300)
    model_cfg = tiny_model_config(
        vocab_size=len(tok),
        attention_bias=False,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.pad_token_id,
    )
    cfg = _config()
    tools = run.setup_tools(cfg)
    engine = scripted_engine(tok, model_cfg)
    sampler = Sampler(engine, tok, ToolExecutor(tools, max_concurrency=2), cfg.rollout)
    params = models.init_params(model_cfg, jax.random.key(0))
    port = free_port()
    server = ToolServer(tool_servicer(sampler, params, 0.0), port, tools)
    try:
        (sample,) = decode(port, text=RECORDS[0]["prompt"])
        assert sample.text.startswith("<code>print(6*7)</code>")
        observation = sample.text.split("<interpreter>")[1].split("</interpreter>")[0]
        assert observation.strip() == "42"  # the sandbox's output, appended server-side
        assert sample.text.rstrip().endswith("\\boxed{42}<|im_end|>")
        assert tok.decode(list(sample.token_ids)) == sample.text
        with pytest.raises(grpc.RpcError, match="text requests"):
            decode(port, token_ids=[1, 2, 3])
        assert "no content" in refused(port)
        details = refused(port, text="6*7 " * 100)  # refused, not cut
        assert "tokens" in details and "rollout.max_prompt_len" in details
    finally:
        server.stop()


def test_listens_on_loopback_only_by_default(served):
    # An unauthenticated plain-text server: another address of this machine (127.0.0.2 is
    # one, on Linux) must not reach it unless --host says so.
    port = served[0]
    socket.create_connection(("127.0.0.1", port), timeout=5).close()
    with pytest.raises(OSError), socket.create_connection(("127.0.0.2", port), timeout=5):
        pass


def test_token_ids_outside_the_vocabulary_are_refused(served):
    port, engine, _, _ = served
    vocab = engine.vocab_size
    for bad in (vocab, -1):  # named, not decoded from a clipped embedding row
        details = refused(port, token_ids=[1, 2, bad, 3])
        assert f"token id {bad} " in details and f"0..{vocab - 1}" in details


def test_a_request_without_content_is_invalid_argument(served):
    port = served[0]
    assert "no content" in refused(port)
    assert "no content" in refused(port, token_ids=[])


def test_an_over_long_prompt_is_refused_not_cut(served):
    port, _, _, tokenizer = served
    # Refused with both lengths, not cut to its last 64 tokens.
    details = refused(port, token_ids=[5] * 65)
    assert "65 tokens" in details and "64" in details
    details = refused(port, text="what is 2 + 3? " * 20)
    assert "tokens" in details and "64" in details
    # The server still answers.
    ids = prompts.encode_prompt(tokenizer, {"prompt": "name a prime"}, None, "Answer briefly.")
    assert [t for s in decode(port, token_ids=ids) for t in s.token_ids]


@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_ctrl_c_stops_serve_with_one_line(run_yaml, tmp_path, inherited):
    """Also when started by a process that ignores SIGINT (the child inherits that)."""
    port = free_port()
    cmd = [sys.executable, "-m", "jaxrl_tools.cli", "serve", "--config", str(run_yaml)]
    ignore = lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)  # noqa: E731
    proc = subprocess.Popen(
        [*cmd, "--port", str(port)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=ignore if inherited == "ignored" else None,
    )
    ready, out = threading.Event(), []

    def read():
        for line in proc.stdout:
            out.append(line)
            ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(180), "serve did not start"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.strip().splitlines()[-1] == "jaxrl-tools: serve stopped (Ctrl-C)"
    assert proc.returncode == 128 + signal.SIGINT


def test_openai_api_serves_the_engines_greedy_tokens(run_yaml, served, tmp_path):
    """`serve --openai`: the official client (sync, streamed and not) gets the greedy tokens of
    the same engine run directly, as text and as the token-id extension fields; a malformed
    request is a 400 naming its field and the server goes on; Ctrl-C stops it with one line."""
    openai = pytest.importorskip("openai")
    _, engine, params, tokenizer = served
    port = free_port()
    cmd = [sys.executable, "-m", "jaxrl_tools.cli", "serve", "--openai", "--config", str(run_yaml)]
    proc = subprocess.Popen(
        [*cmd, "--port", str(port)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    ready = threading.Event()

    def read():
        for line in proc.stdout:
            if "OpenAI API on" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(180), "serve --openai did not start"
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
        messages = [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "what is 2 + 3?"},
        ]
        ids = prompts.encode_prompt(tokenizer, {"prompt": messages}, None)
        want = stop_at_eos(greedy(engine, params, ids), engine)
        r = client.chat.completions.create(
            model="any", messages=messages, max_tokens=N, temperature=0, logprobs=True
        )
        choice = r.choices[0]
        assert (
            choice.model_extra["token_ids"] == want
            and choice.model_extra["prompt_token_ids"] == ids
        )
        assert choice.message.content == tokenizer.decode(want)
        assert choice.finish_reason == "length" and r.usage.completion_tokens == N
        assert len(choice.logprobs.content) == N
        streamed = client.chat.completions.create(
            model="any", messages=messages, max_tokens=N, temperature=0, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        assert text == choice.message.content
        with pytest.raises(openai.BadRequestError, match="temperature"):
            client.chat.completions.create(model="any", messages=messages, temperature=-1)
        assert [m.id for m in client.models.list().data]  # and it still serves
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "jaxrl-tools: serve stopped (Ctrl-C)"


def test_openai_api_on_a_taken_port_is_one_line_before_anything_loads(run_yaml, capsys):
    pytest.importorskip("uvicorn")
    from jaxrl_tools.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["serve", "--openai", "--config", str(run_yaml), "--port", str(port)]
        assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"jaxrl-tools: serve --openai: cannot listen on 127.0.0.1:{port}")
    assert "pick another --port" in err[-1]
