"""`kvbuffer serve` on CUDA: the demo model in both modes, plain and speculative, with the compiled
kernels and CUDA graphs when they load; streamed texts under concurrency equal LLM.generate's on
the same GPU, and the requests' slots all come back."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from kvbuffer import LLM, demo_checkpoint  # noqa: E402
from kvbuffer.serve.launch import ServerProcess  # noqa: E402

pytestmark = pytest.mark.gpu

PROMPTS = [f"{w} {i} " for i in range(24) for w in ("The", "def", "import", "class")]  # 96 prompts
N_TOKENS = 48


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["kvbuffer", "recurrent"])
@pytest.mark.parametrize("speculative", [None, "ngram"], ids=["plain", "ngram"])
def test_serve_on_cuda_matches_generate(mode, speculative):
    spec = ["--speculative", speculative, "--draft-tokens", "3"] if speculative else []
    # fp32 weights on both sides: greedy ties that bf16 rounding could break differently per batch are rarer
    want = [o.text for o in LLM(str(demo_checkpoint()), device="cuda", dtype=torch.float32, mode=mode, max_batch=32,
                                max_len=512, speculative={"method": speculative, "num_draft_tokens": 3}
                                if speculative else None).generate(PROMPTS, max_new_tokens=N_TOKENS)]
    with ServerProcess("--device", "cuda", "--dtype", "float32", "--mode", mode, "--max-batch", "32", "--max-len", "512",
                       "--log-level", "warning", *spec) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0)

        def one(p):
            chunks = client.completions.create(model="demo", prompt=p, max_tokens=N_TOKENS, temperature=0, stream=True)
            return "".join(c.choices[0].text for c in chunks)

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(one, PROMPTS, timeout=300))
        assert got == want
        h = server.wait_idle()
        assert (h["in_flight"], h["request_slots_free"]) == (0, 32)
