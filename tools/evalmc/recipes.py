"""The prompt of each benchmark: one user message per item, few-shot examples from a dev split.

ceval follows OpenCompass (5-shot, "答案: " continuation), mmlu_pro follows lm-eval (5-shot
chain of thought ending in "the answer is (X)"), mmlu_redux and supergpqa are zero-shot with an
"Answer: $LETTER" instruction.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from phalanx.tools.evalmc.data import Item

SHOTS = 5


def _option_lines(item: Item, sep: str) -> str:
    return "\n".join(f"{letter}{sep}{text}" for letter, text in zip(item.letters, item.options, strict=True))


def _ceval(item: Item, shots: list[Item]) -> str:
    head = f"以下是中国关于{item.subject}考试的单项选择题，请选出其中的正确答案。\n\n"
    body = "".join(f"{s.question}\n{_option_lines(s, '. ')}\n答案: {s.answer}\n\n" for s in shots)
    return f"{head}{body}{item.question}\n{_option_lines(item, '. ')}\n答案: "


def _mmlu_pro_question(item: Item) -> str:
    return f"Question:\n{item.question}\nOptions:\n{_option_lines(item, '. ')}\n"


def _mmlu_pro(item: Item, shots: list[Item]) -> str:
    head = (
        f"The following are multiple choice questions (with answers) about {item.subject}. Think step by"
        ' step and then finish your answer with "the answer is (X)" where X is the correct letter choice.\n\n'
    )
    # lm-eval stores the worked solution as "A: Let's think step by step. ..."
    body = "".join(
        f"{_mmlu_pro_question(s)}Answer: {s.cot.removeprefix('A:').strip()}\n\n" for s in shots if s.cot
    )
    return f"{head}{body}{_mmlu_pro_question(item)}Answer: Let's think step by step."


def _answer_letter_prompt(item: Item) -> str:
    return (
        "Answer the following multiple choice question. There is only one correct answer. The last line"
        " of your response should be in the format 'Answer: $LETTER' (without quotes), where LETTER is"
        f" one of {', '.join(item.letters)}.\n\n{item.question}\n{_option_lines(item, ') ')}"
    )


def _zero_shot(item: Item, shots: list[Item]) -> str:
    return _answer_letter_prompt(item)


@dataclass(frozen=True)
class Recipe:
    name: str
    build: Callable[[Item, list[Item]], str]
    uses_shots: bool


RECIPES: dict[str, Recipe] = {
    "ceval": Recipe("ceval", _ceval, uses_shots=True),
    "mmlu_pro": Recipe("mmlu_pro", _mmlu_pro, uses_shots=True),
    "mmlu_redux": Recipe("mmlu_redux", _zero_shot, uses_shots=False),
    "supergpqa": Recipe("supergpqa", _zero_shot, uses_shots=False),
}


def build_prompts(recipe: Recipe, items: list[Item], dev: list[Item]) -> list[str]:
    """One prompt per item; few-shot examples are the first SHOTS dev items of the same subject."""
    shots_by_subject: dict[str, list[Item]] = defaultdict(list)
    if recipe.uses_shots:
        for example in dev:
            if len(shots_by_subject[example.subject]) < SHOTS:
                shots_by_subject[example.subject].append(example)
    return [recipe.build(item, shots_by_subject.get(item.subject, [])) for item in items]
