"""`jaxrl-tools serve`: JetStream's gRPC client gets the tokens the engine generates.

A tiny random policy with the demo tokenizer (it has a chat template) is served on a free port;
JetStream's own stub sends token-id and text requests, and the answers must be the greedy
tokens of the same engine run directly on the same prompt (rendered through the chat template
for a text request). Several requests in a row also exercise slots freed and refilled.
"""

import socket

import numpy as np
import pytest
import yaml
from fakes import TINY_RUN_MODEL

from jaxrl_tools import prompts, run
from jaxrl_tools.config_loader import load_config
from jaxrl_tools.demo.tokenizer import build_tokenizer

N = 12  # tokens per request


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from jaxrl_tools.serve import make_engine, start_server

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
    cfg = load_config(path, [])
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    server = start_server(cfg, from_checkpoint=False, step=None, port=port)
    # The reference: the same policy (same seed) in an engine of its own, stepped directly.
    tokenizer = run.setup_tokenizer(cfg)
    model_cfg, params = run.setup_model(cfg, tokenizer)
    engine = make_engine(cfg, model_cfg, params, tokenizer)
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
    import grpc
    from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc

    with grpc.insecure_channel(f"localhost:{port}") as channel:
        stub = jetstream_pb2_grpc.OrchestratorStub(channel)
        if "text" in content:
            what = {"text_content": jetstream_pb2.DecodeRequest.TextContent(text=content["text"])}
        else:
            ids = content["token_ids"]
            what = {"token_content": jetstream_pb2.DecodeRequest.TokenContent(token_ids=ids)}
        request = jetstream_pb2.DecodeRequest(max_tokens=N, **what)
        return [s for r in stub.Decode(request, timeout=120) for s in r.stream_content.samples]


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
