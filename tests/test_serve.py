"""`jaxrl-tools serve`: JetStream's gRPC client gets the tokens the engine generates, and with
`--tools` answers whose tool calls ran server-side in the sandbox.

A tiny random policy with the demo tokenizer (it has a chat template) is served on a free port;
JetStream's own stub sends token-id and text requests, and the answers must be the greedy
tokens of the same engine run directly on the same prompt (rendered through the chat template
for a text request). Several requests in a row also exercise slots freed and refilled.
"""

import socket

import jax
import jax.numpy as jnp
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


def test_tools_run_server_side_in_the_sandbox(tmp_path):
    # The ReTool recipe of tests/test_train_e2e.py: a tiny policy scripted (logits hook) to call
    # the Python tool on "6*7" and then answer; the real sandbox runs the call.
    import grpc
    from test_train_e2e import RECORDS, _config, _scripts, forcing_hook

    from jaxrl_tools import models
    from jaxrl_tools.rollout import EngineCore, Sampler
    from jaxrl_tools.serve import ToolServer, tool_servicer
    from jaxrl_tools.tools import ToolExecutor

    tok = build_tokenizer(tmp_path / "tok", vocab_size=300)
    model_cfg = models.ModelConfig(
        model_type="qwen2",
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.pad_token_id,
    )
    cfg = _config()
    tools = run.setup_tools(cfg)
    engine = EngineCore(
        model_cfg,
        None,
        slots=8,
        max_len=128,
        max_prefill_length=64,
        tokenizer=tok,
        logits_hook=forcing_hook,
        hook_data=jnp.asarray(_scripts(tok)),
    )
    sampler = Sampler(engine, tok, ToolExecutor(tools, max_concurrency=2), cfg.rollout)
    params = models.init_params(model_cfg, jax.random.key(0))
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
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
    finally:
        server.stop()
