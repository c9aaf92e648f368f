"""The command-line side: running a script (cli, options, help) and its files (prompts, job_output),
the demo model, and the commands users run with `python -m llama_tp.<command>`: convert, reshard,
plan, run_batch; the benchmarks have a room of their own (bench/)."""
