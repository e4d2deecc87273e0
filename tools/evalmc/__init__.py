"""Multiple-choice knowledge evaluation over an OpenAI-compatible chat completions API.

``phalanx eval-mc`` (tools/eval_mc.py) is the entry point; the dataset format is documented in
docs/eval-mc.md.
"""
