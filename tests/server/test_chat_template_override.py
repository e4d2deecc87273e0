"""``--chat-template``: a template file or the template's text replaces the checkpoint's, and one
that is neither, or does not compile, stops ``phalanx serve`` before any rank starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.server.chat_template import ChatTemplate, ChatTemplateError
from phalanx.tools.cli import main

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{{ eos_token }}"
MESSAGES = [{"role": "user", "content": "hi"}]


def test_a_file_or_the_text_replaces_the_checkpoints_template(tiny_model_dir: Path, tmp_path: Path) -> None:
    checkpoint = ChatTemplate.from_model_dir(tiny_model_dir)
    template_file = tmp_path / "plain.jinja"
    template_file.write_text(TEMPLATE)
    from_file = ChatTemplate.from_model_dir(tiny_model_dir, str(template_file))
    inline = ChatTemplate.from_model_dir(tiny_model_dir, TEMPLATE)
    expected = f"<user>hi{checkpoint.eos_token}"  # the checkpoint's special tokens still apply
    assert from_file.render(MESSAGES) == inline.render(MESSAGES) == expected
    assert checkpoint.render(MESSAGES) != expected


def test_a_template_that_is_neither_a_file_nor_jinja_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(
        ChatTemplateError, match="chat template 'no-such.jinja' is neither a file nor a jinja"
    ):
        ChatTemplate.from_model_dir(tiny_model_dir, "no-such.jinja")
    with pytest.raises(ChatTemplateError, match="chat template does not compile"):
        ChatTemplate.from_model_dir(tiny_model_dir, "{% for %}")


def test_serve_refuses_a_bad_chat_template_before_launching(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--model", str(tiny_model_dir), "--chat-template", "{{ broken", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("phalanx serve: error: --chat-template: chat template does not compile: "), err
