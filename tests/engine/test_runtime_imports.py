"""The runtime never needs the compile side: building and running an LLM imports nothing from
kvbuffer.autotune or kvbuffer.tiles, and neither TileLang nor TVM (checked in a fresh interpreter,
where no other test has imported them)."""

import subprocess
import sys

CODE = """
import sys
import kvbuffer
llm = kvbuffer.LLM(kvbuffer.demo_checkpoint(), device="cpu", max_batch=2, max_len=64)
out = llm.generate([[1, 2, 3, 4, 5]], max_new_tokens=4)
assert len(out[0].token_ids) == 4, out
compile_side = ("kvbuffer.autotune", "kvbuffer.tiles", "tilelang", "tvm", "tvm_ffi")
print(sorted(m for m in sys.modules if m.split(".")[0] in compile_side or m.startswith(compile_side)))
"""


def test_llm_runs_without_importing_the_compile_side():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
