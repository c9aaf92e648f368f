"""The engine under every door: which sequences run, the blocks of the KV cache they hold, and each step."""
