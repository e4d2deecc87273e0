"""eval-mc logic that needs no model: extraction, sampling, checkpoint repair, resume, rerun.

The chat API here is a small in-test HTTP stub, used only for the checkpoint and rerun logic; the
end-to-end run against the real server is in test_eval_mc_live.py.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from phalanx.tools.cli import main as phalanx
from phalanx.tools.evalmc.checkpoint import repair_jsonl_tail
from phalanx.tools.evalmc.data import DatasetError, Item, load_items, load_paths, stratified_sample
from phalanx.tools.evalmc.extract import extract_answer
from phalanx.tools.evalmc.recipes import RECIPES, build_prompts

OPTIONS = ("Paris", "London", "New York", "New York City")


@pytest.mark.parametrize(
    ("reply", "letter", "method"),
    [
        ("Answer: B", "B", "marker"),  # not the "A" of "Answer"
        ("**Answer:** C", "C", "marker"),
        ("Let me think. A is wrong. The answer is (D).", "D", "marker"),
        ("答案：B", "B", "marker"),
        ("Answer: E is not an option. Answer: C", "C", "marker"),
        ("\\boxed{A}", "A", "marker"),
        ("I weighed the options.\n(C)\n", "C", "letter_line"),
        ("B. 巴黎", "B", "leading_letter"),
        ("It must be New York City.", "D", "option_text"),  # longest option first
        ("Surely london.", "B", "option_text"),
        ("<think>Answer: A</think>Answer: B", "B", "marker"),  # thinking is not the answer
        ("the answer is correct", None, "none"),
        ("", None, "none"),
    ],
)
def test_extractor(reply: str, letter: str | None, method: str) -> None:
    found = extract_answer(reply, OPTIONS, "ABCD")
    assert (found.letter, found.method) == (letter, method)


def _items(counts: dict[str, int]) -> list[Item]:
    return [Item(f"{s}-{i}", s, f"q {s} {i}", ("x", "y"), "A") for s, n in counts.items() for i in range(n)]


def test_stratified_sample_exact_totals_and_proportions() -> None:
    items = _items({"math": 50, "law": 30, "art": 20, "tiny": 1})
    for n in (1, 7, 10, 33, 100):
        picked = stratified_sample(items, n)
        assert len(picked) == n
        assert len({p.id for p in picked}) == n
        per = Counter(p.subject for p in picked)
        for subject, size in {"math": 50, "law": 30, "art": 20, "tiny": 1}.items():
            assert abs(per[subject] - n * size / 101) < 1.0
    assert stratified_sample(items, 33) == stratified_sample(items, 33)  # seeded
    assert len(stratified_sample(items, 500)) == 101


def test_dataset_native_layouts(tmp_path: Path) -> None:
    rows = [
        {"id": 1, "question": "c?", "A": "a", "B": "b", "C": "c", "D": "d", "answer": "C"},  # ceval
        {"question": "r?", "choices": ["a", "b"], "answer": 1, "subject": "anatomy"},  # mmlu-redux
        {"question_id": 7, "question": "p?", "options": ["a", "b", "c"], "answer": "A", "category": "law"},
        {"uuid": "u", "question": "s?", "options": ["x", "y"], "answer": "y", "discipline": "Science"},
    ]
    path = tmp_path / "computer_network.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    items = load_items(path)
    assert [(i.subject, i.answer, len(i.options)) for i in items] == [
        ("computer_network", "C", 4),
        ("anatomy", "B", 2),
        ("law", "A", 3),
        ("Science", "B", 2),
    ]
    import pyarrow as pa
    import pyarrow.parquet as pq

    pro = [
        {"question_id": i, "question": f"p{i}?", "options": ["a", "b", "c"], "answer": "B", "category": "law"}
        for i in range(3)
    ]
    pq.write_table(pa.Table.from_pylist(pro), tmp_path / "mmlu_pro.parquet")
    assert [(i.id, i.subject, i.answer) for i in load_paths([tmp_path])][:4] == [
        ("1", "computer_network", "C"),
        ("computer_network-1", "anatomy", "B"),
        ("7", "law", "A"),
        ("u", "Science", "B"),
    ]
    assert [i.id for i in load_paths([tmp_path / "mmlu_pro.parquet"])] == ["0", "1", "2"]
    path.write_text(json.dumps({"question": "q", "options": ["a", "b"], "answer": "Z"}) + "\n")
    with pytest.raises(DatasetError, match="row 0: answer 'Z' is neither a letter in AB"):
        load_items(path)


def test_recipes_few_shot_and_zero_shot() -> None:
    def item(subject: str, n: int, cot: str = "") -> Item:
        return Item(f"{subject}{n}", subject, f"Q{subject}{n}?", ("x", "y", "z"), "C", cot)

    dev = [item("law", i, cot=f"A: Let's think step by step. law {i}. The answer is (C).") for i in range(7)]
    dev += [item("art", 0)]
    (ceval,) = build_prompts(RECIPES["ceval"], [item("law", 99)], dev)
    assert ceval.startswith("以下是中国关于law考试的单项选择题")
    assert ceval.count("答案: C\n\n") == 5 and "Qart0" not in ceval  # 5 shots, same subject only
    assert ceval.endswith("Qlaw99?\nA. x\nB. y\nC. z\n答案: ")
    (pro,) = build_prompts(RECIPES["mmlu_pro"], [item("law", 99)], dev)
    assert pro.count("Answer: Let's think step by step. law") == 5
    assert pro.endswith("Question:\nQlaw99?\nOptions:\nA. x\nB. y\nC. z\nAnswer: Let's think step by step.")
    (redux,) = build_prompts(RECIPES["mmlu_redux"], [item("art", 5)], dev)
    assert "Qart0" not in redux and "where LETTER is one of A, B, C." in redux and redux.endswith("C) z")


def test_repair_torn_tail(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text('{"idx": 0}\n{"idx": 1}\n{"idx": 2, "cont')
    assert repair_jsonl_tail(path) == [{"idx": 0}, {"idx": 1}]
    assert path.read_text() == '{"idx": 0}\n{"idx": 1}\n'
    path.write_text('{"idx": 0}\nnot json\n{"idx": 2}')  # a corrupt middle line, no final newline
    assert repair_jsonl_tail(path) == [{"idx": 0}, {"idx": 2}]
    assert path.read_text() == '{"idx": 0}\n{"idx": 2}\n'


class ChatStub:
    """A chat completions endpoint whose reply is ``respond(prompt) -> (status, content, finish)``."""

    def __init__(self, respond: Callable[[str], tuple[int, str, str]]) -> None:
        self.respond = respond
        self.prompts: list[str] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                prompt = body["messages"][0]["content"]
                stub.prompts.append(prompt)
                status, content, finish = stub.respond(prompt)
                reply = {
                    "choices": [
                        {"message": {"role": "assistant", "content": content}, "finish_reason": finish}
                    ],
                    "usage": {"completion_tokens": 3},
                }
                data = json.dumps(reply if status == 200 else {"error": {"message": "bad"}}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def stub() -> Iterator[ChatStub]:
    s = ChatStub(lambda prompt: (200, "Answer: A", "stop"))
    yield s
    s.server.shutdown()


def _dataset(tmp_path: Path, n: int = 6) -> Path:
    path = tmp_path / "data.jsonl"
    rows = [
        {"question": f"question {i}", "options": ["yes", "no"], "answer": "A" if i % 2 else "B"}
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _eval(stub: ChatStub, data: Path, out: Path, *extra: str) -> int:
    argv = [
        "eval-mc",
        "--bench",
        "mmlu_redux",
        "--data",
        str(data),
        "--out",
        str(out),
        "--base-url",
        stub.url,
    ]
    return phalanx(
        [*argv, "--model", "m", "--max-tokens", "8", "--concurrency", "2", "--attempts", "1", *extra]
    )


def _summary(out: Path) -> dict:
    return json.loads((out / "mmlu_redux_summary.json").read_text())


def test_resume_rescores_recovered_rows_and_fingerprint_guards(stub: ChatStub, tmp_path: Path) -> None:
    data, out = _dataset(tmp_path), tmp_path / "out"
    assert _eval(stub, data, out) == 0
    assert _summary(out)["acc"] == 50.0
    partial = out / "mmlu_redux_samples.partial.jsonl"
    rows = [json.loads(line) for line in partial.read_text().splitlines()]
    # a checkpoint written by an older extractor that scored "Answer: A" wrongly
    for row in rows:
        row.update(pred="X", correct=False)
    partial.write_text("".join(json.dumps(r) + "\n" for r in rows[:4]) + json.dumps(rows[4])[:25])
    stub.prompts.clear()
    assert _eval(stub, data, out) == 0
    summary = _summary(out)
    assert (summary["recovered_samples"], summary["n"], summary["acc"]) == (4, 6, 50.0)
    assert len(stub.prompts) == 2  # only the torn row and the missing row were asked again
    samples = json.loads((out / "mmlu_redux_samples.json").read_text())
    assert [s["idx"] for s in samples] == list(range(6))
    # another max_tokens is another run: the checkpoint is discarded
    stub.prompts.clear()
    assert _eval(stub, data, out, "--max-tokens", "9") == 0
    assert _summary(out)["recovered_samples"] == 0 and len(stub.prompts) == 6


def test_api_errors_make_the_run_incomplete_and_resume_retries_them(stub: ChatStub, tmp_path: Path) -> None:
    data, out = _dataset(tmp_path), tmp_path / "out"
    stub.respond = lambda prompt: (400, "", "") if "question 3" in prompt else (200, "Answer: A", "stop")
    assert _eval(stub, data, out) == 2
    summary = _summary(out)
    assert summary["incomplete"] and summary["api_errors"] == 1
    stub.respond = lambda prompt: (200, "Answer: A", "stop")
    stub.prompts.clear()
    assert _eval(stub, data, out) == 0
    assert len(stub.prompts) == 1 and "question 3" in stub.prompts[0]
    assert _summary(out)["recovered_samples"] == 5


def test_rerun_truncated_rows(stub: ChatStub, tmp_path: Path) -> None:
    data, out = _dataset(tmp_path), tmp_path / "out"
    stub.respond = lambda prompt: (
        (200, "", "length") if "question 0" in prompt else (200, "Answer: A", "stop")
    )
    assert _eval(stub, data, out) == 0
    assert _summary(out)["truncated_thinking"] == 1
    base = ["eval-mc", "--bench", "mmlu_redux", "--out", str(out), "--rerun-truncated", "--max-tokens", "64"]
    assert phalanx([*base, "--model", "other"]) == 1  # refuses a different model
    assert phalanx(base) == 2  # still truncated at the larger budget
    assert _summary(out)["still_truncated"] == 1
    stub.respond = lambda prompt: (200, "Answer: B", "stop")
    stub.prompts.clear()
    assert phalanx(base) == 2  # resuming the same rerun asks nothing again
    assert stub.prompts == []
    assert phalanx([*base, "--max-tokens", "128"]) == 0
    assert len(stub.prompts) == 1
    summary = _summary(out)
    assert (summary["rerun_n"], summary["still_truncated"], summary["acc"], summary["acc_merged"]) == (
        1,
        0,
        50.0,
        66.67,
    )
    merged = json.loads((out / "mmlu_redux_samples_merged.json").read_text())
    assert merged[0]["rerun"] and merged[0]["pred"] == "B"
