"""ReTool's cold start (datasets/retool_coldstart.py): text traces rewritten by a model behind a
real OpenAI-compatible endpoint (a fixed-response server here), every block run in the sandbox,
the real outputs spliced in, each filter counted; and the kept traces as SFT segments."""

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from jaxrl_tools import cli, prompts
from jaxrl_tools.data import load_sft_traces
from jaxrl_tools.tasks.tokenizer import build_tokenizer
from jaxrl_tools.tools import get_parser

FENCE = "```"


def code(body: str) -> str:
    return f"<code>\n{FENCE}python\n{body}\n{FENCE}\n</code>"


# problem -> what the rewriter answers (None: the endpoint fails the request)
REWRITES = {
    "What is 6 times 7?": f"Multiply.\n{code('print(6*7)')}\nSo it is \\boxed{{42}}.",
    "Two steps: 6, then times 7?": (
        f"First {code('x = 6')}\nthen {code('print(x * 7)')}\n"
        "<interpreter>\n41\n</interpreter>\nThe answer is \\boxed{42}."  # its guess is dropped
    ),
    "What is 5 plus 5?": f"{code('print(5+5)')}\nIt is \\boxed{{11}}.",  # wrong answer
    "What is 1 over 0?": f"{code('print(1/0)')}\n\\boxed{{0}}",  # the code fails
    "What is 2 plus 2?": "Two and two make \\boxed{4}.",  # no code
    "What is 3 plus 3?": "<code>\nprint(3+3)\n\\boxed{6}",  # unterminated
    "What is 9 minus 1?": None,
}
ANSWERS = {"What is 6 times 7?": "42", "Two steps: 6, then times 7?": "42",
           "What is 5 plus 5?": "10", "What is 1 over 0?": "0", "What is 2 plus 2?": "4",
           "What is 3 plus 3?": "6", "What is 9 minus 1?": "8"}  # fmt: skip


class Rewriter(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert self.path == "/v1/chat/completions" and body["model"] == "rewriter"
        problem = re.search(r"Problem:\n(.*?)\n\nSolution:", body["messages"][0]["content"])[1]
        answer = REWRITES[problem]
        if answer is None:
            self.send_response(500)
            self.end_headers()
            return
        out = json.dumps({"choices": [{"message": {"role": "assistant", "content": answer}}]})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(out.encode())

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def endpoint():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Rewriter)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


def test_cold_start_splices_real_outputs_and_counts_every_rejection(endpoint, tmp_path, capsys):
    src = tmp_path / "text_traces.jsonl"
    src.write_text("".join(
        json.dumps({"problem": p, "solution": "by hand", "answer": a}) + "\n"
        for p, a in ANSWERS.items()
    ))  # fmt: skip
    out = tmp_path / "coldstart.jsonl"
    argv = ["prepare", "retool-coldstart", "--input", str(src), "--output", str(out)]
    assert cli.main([*argv, "--endpoint", endpoint, "--model", "rewriter"]) == 0
    printed = capsys.readouterr().out
    assert (
        "kept 2 of 7 traces (request_failed 1, no_code 1, unparsable 1, code_failed 1, "
        "wrong_answer 1)" in printed
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["What is 6 times 7?", "Two steps: 6, then times 7?"]
    # The tool's output as the rollout inserts it (stdout "42\n", in the parser's markup).
    assert rows[0]["response"] == (
        f"Multiply.\n{code('print(6*7)')}\n<interpreter>\n42\n\n</interpreter>\n"
        "So it is \\boxed{42}."
    )
    # One session per trace: the second block sees the first's x; the rewriter's 41 is gone.
    assert rows[1]["response"] == (
        f"First {code('x = 6')}\n<interpreter>\n\n</interpreter>\nthen "
        f"{code('print(x * 7)')}\n<interpreter>\n42\n\n</interpreter>\nThe answer is \\boxed{{42}}."
    )
    assert rows[1]["ground_truth"] == "42"
    # What the rollout inserts is what the parser formats after a </code> stop.
    assert (
        get_parser("retool").format_observation(["42"]) == "\n<interpreter>\n42\n</interpreter>\n"
    )
    assert cli.main([*argv[:-1], str(tmp_path / "x.jsonl")]) == 2
    assert "retool-coldstart needs --endpoint" in capsys.readouterr().err


def test_cold_start_traces_train_the_model_text_not_the_outputs(tmp_path):
    tok = build_tokenizer(tmp_path / "tok", vocab_size=400)
    response = (
        f"Multiply.\n{code('print(6*7)')}\n<interpreter>\n42\n</interpreter>\n"
        "So it is \\boxed{42}."
    )
    path = tmp_path / "coldstart.jsonl"
    row = {"prompt": "What is 6 times 7?", "response": response, "ground_truth": "42"}
    path.write_text(json.dumps(row) + "\n")
    pattern = prompts.observation_pattern(get_parser("retool").format_observation)
    (segments,) = load_sft_traces(
        [path], lambda r: prompts.trace_segments(tok, r, "Use code.", pattern)
    )
    context = prompts.render_prompt(tok, row, None, "Use code.")
    assert segments[0] == [context, False]
    assert [t for t, trained in segments[1:] if not trained][0] == (
        "\n<interpreter>\n42\n</interpreter>\n"
    )
    trained = "".join(t for t, on in segments if on)
    assert trained.startswith(f"Multiply.\n{code('print(6*7)')}")
    assert "So it is \\boxed{42}." in trained and "42\n</interpreter>" not in trained
    assert "".join(t for t, _ in segments) == tok.apply_chat_template(
        [{"role": "system", "content": "Use code."}, {"role": "user", "content": row["prompt"]},
         {"role": "assistant", "content": response}], tokenize=False
    )  # fmt: skip
    with pytest.raises(Exception, match="needs a tokenizer"):
        load_sft_traces([path])


def test_response_traces_need_an_inline_protocol(tmp_path):
    from fakes import tiny_run_config

    from jaxrl_tools import records
    from jaxrl_tools.config_loader import config_from_dict
    from jaxrl_tools.data import DataError

    path = tmp_path / "coldstart.jsonl"
    path.write_text(json.dumps({"prompt": "q", "response": "a"}) + "\n")
    raw = tiny_run_config(tmp_path, "chat", "math", rollout={"protocol": "qwen"})
    cfg = config_from_dict({**raw, "sft": {"enabled": True, "train_files": [str(path)]}})
    with pytest.raises(DataError, match=r"needs an inline protocol \(rollout\.protocol 'qwen'"):
        records.sft_traces(cfg, None)
