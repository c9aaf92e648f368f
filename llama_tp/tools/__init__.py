"""The command-line side: running a script (cli) and its files (prompts), the demo model, and the
tools users run with `python -m llama_tp.<tool>`: convert, reshard, plan, bench (and the
benchmark's helpers), answer_agreement."""
