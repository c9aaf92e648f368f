"""llama.cpp's own tools beside a benchmark of ours on the same GGUF file: its converter
(convert_hf_to_gguf.py, in the source tree ../shared/tools/build-llama-cpp.sh builds from) makes
the file from a Hugging Face folder, and `llama-bench` times its decoding."""

import json
import os
import subprocess
import sys
from pathlib import Path


class LlamaCpp:
    """A llama.cpp build: the folder build-llama-cpp.sh prints (build/bin), beside its sources (src)."""

    def __init__(self, bin_dir: str):
        self.bin = Path(bin_dir)
        self.bench = self.bin / "llama-bench"
        self.converter = self.bin.parents[1] / "src" / "convert_hf_to_gguf.py"
        for path in (self.bench, self.converter):
            if not path.is_file():
                raise FileNotFoundError(f"--llama_cpp {bin_dir} has no {path.name} where build-llama-cpp.sh puts it "
                                        f"({path}); build it with ../shared/tools/build-llama-cpp.sh and pass the "
                                        "folder it prints")

    def convert(self, hf_folder: Path, gguf: Path, outtype: str) -> None:
        """The GGUF file llama.cpp's converter makes of a Hugging Face folder (outtype: f32, f16, q8_0, ...)."""
        subprocess.run([sys.executable, str(self.converter), str(hf_folder), "--outtype", outtype, "--outfile",
                        str(gguf)], check=True, capture_output=True, text=True)

    def decode_speed(self, gguf: Path, new_tokens: int, threads: int) -> float:
        """llama-bench's decoding speed of one sequence (its tg test, no prompt), tokens per second."""
        result = subprocess.run([str(self.bench), "-m", str(gguf), "-p", "0", "-n", str(new_tokens), "-t",
                                 str(threads), "-r", "1", "-o", "json"], check=True, capture_output=True, text=True,
                                env=os.environ | {"OMP_NUM_THREADS": str(threads)})
        (test,) = json.loads(result.stdout)
        return float(test["avg_ts"])

    def version(self) -> str:
        result = subprocess.run([str(self.bench), "--version"], capture_output=True, text=True)
        return (result.stdout or result.stderr).strip().splitlines()[0] if result.returncode == 0 else "unknown"
