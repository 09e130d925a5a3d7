"""A folder that makes the servers' ReplaySSM kernels importable without installing vLLM or SGLang.

`kvbuffer bench gdn|mamba2` import the ReplaySSM kernels by their module names
(kvbuffer.bench.replayssm.MODULES). An installed vllm / sglang serves; where neither can be
installed (their wheels pin a torch and pull a server's dependencies), this writes a folder to put
on PYTHONPATH instead:

    python -m kvbuffer.bench.peer_sources --out DIR vllm-*.whl sglang-*.whl

It holds the kernel files exactly as the wheels ship them (KERNEL_FILES), empty package
`__init__.py` files, and stand-ins for the few helpers the kernel files import from the servers'
heavier modules (STAND_INS): the platform queries answered the way the servers answer them on
an NVIDIA GPU, and vLLM's two Triton helpers (`softplus`, `convert_rs_fp16x2`) cut out of the
wheel's own `mamba_ssm.py`. Nothing of theirs is stored in kvbuffer: every file is read from the
wheel given.
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import sys
import zipfile

KERNEL_FILES = {
    "sglang": ("sglang/kernels/ops/attention/linear/fused_recurrent_linear_replayssm.py",
               "sglang/kernels/ops/attention/linear/gdn_replayssm_spec_decode.py"),
    "vllm": ("vllm/model_executor/layers/mamba/ops/selective_state_update_replayssm_output_only.py",
             "vllm/model_executor/layers/mamba/ops/replayssm_config.py"),
}

_TRITON = "import triton\nimport triton.language as tl\n"
_CAPABILITY = ("import torch\n\n\ndef _capability():\n"
               "    return torch.cuda.get_device_capability(0) if torch.cuda.is_available() else (0, 0)\n")

# path -> text; "{vllm_triton_helpers}" is filled from the wheel (vllm_triton_helpers)
STAND_INS = {
    "sglang": {
        "sglang/kernels/ops/attention/fla/utils.py": _CAPABILITY + (
            "\n\n# SGLang's rule (fla/utils.py): TF32 dots on NVIDIA Ampere or newer\n"
            "is_tf32_supported = not torch.version.hip and _capability()[0] >= 8\n"),
        "sglang/srt/utils/__init__.py": (
            "import torch\n\n\ndef is_gfx95_supported():\n"
            "    \"\"\"SGLang's rule: an AMD gfx95 GPU; False on every non-HIP build.\"\"\"\n"
            "    return bool(torch.version.hip) and 'gfx95' in torch.cuda.get_device_properties(0).gcnArchName\n"),
    },
    "vllm": {
        "vllm/triton_utils/__init__.py": "HAS_TRITON = True\n" + _TRITON,
        "vllm/platforms/__init__.py": _CAPABILITY + (
            "\n\nclass _Platform:\n"
            "    \"\"\"The two questions the ReplaySSM kernel asks of vLLM's current_platform.\"\"\"\n\n"
            "    def is_rocm(self):\n        return bool(torch.version.hip)\n\n"
            "    def is_device_capability_family(self, family):\n"
            "        major, minor = _capability()\n"
            "        return (major * 10 + minor) // 10 == family // 10  # vLLM's rule\n\n\n"
            "current_platform = _Platform()\n"),
        "vllm/v1/attention/backends/utils.py": "NULL_BLOCK_ID = 0  # vLLM's value (v1/attention/backends/utils.py)\n",
        "vllm/model_executor/layers/mamba/ops/mamba_ssm.py": "{vllm_triton_helpers}",
    },
}


def vllm_triton_helpers(source: str) -> str:
    """The module text of vLLM's `softplus` (its Triton 3 form) and `convert_rs_fp16x2`, cut out
    of `source` (the wheel's mamba_ssm.py) with their decorators."""
    tree = ast.parse(source)
    found = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "convert_rs_fp16x2":
            found[node.name] = node
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TRITON3":
            found.update({n.name: n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "softplus"})
    missing = {"softplus", "convert_rs_fp16x2"} - set(found)
    if missing:
        raise ValueError(f"vLLM's mamba_ssm.py has no {sorted(missing)}: not the vLLM this folder is made for")
    lines = source.splitlines()
    parts = []
    for node in found.values():
        start = min(d.lineno for d in node.decorator_list) - 1
        parts.append("\n".join(line[node.col_offset:] for line in lines[start:node.end_lineno]))
    head = "# cut out of vLLM's mamba_ssm.py by kvbuffer.bench.peer_sources\n" + _TRITON
    return head + "\n\n" + "\n\n\n".join(parts) + "\n"


def _package(wheel: pathlib.Path) -> str:
    name = wheel.name.split("-")[0].lower()
    if name not in KERNEL_FILES:
        raise ValueError(f"wheels: {wheel.name} is neither a vllm nor an sglang wheel")
    return name


def write_tree(out: pathlib.Path, wheels: list[pathlib.Path]) -> list[str]:
    """Write the folder for `wheels` (vllm and/or sglang) under `out`; returns the files written."""
    packages = {_package(w): w for w in wheels}  # checked before anything is written
    written = {}
    for name, wheel in packages.items():
        with zipfile.ZipFile(wheel) as z:
            for path in KERNEL_FILES[name]:
                written[path] = z.read(path).decode()
            for path, text in STAND_INS[name].items():
                if text == "{vllm_triton_helpers}":
                    text = vllm_triton_helpers(z.read(path).decode())
                written[path] = text
    for path in list(written):
        for parent in pathlib.PurePosixPath(path).parents:
            if str(parent) != ".":
                written.setdefault(f"{parent}/__init__.py", "")
    for path, text in sorted(written.items()):
        target = out / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return sorted(written)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbuffer.bench.peer_sources", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=pathlib.Path, help="the folder to write (put it on PYTHONPATH)")
    parser.add_argument("wheels", nargs="+", type=pathlib.Path, help="vllm and/or sglang wheel files")
    args = parser.parse_args(argv)
    try:
        files = write_tree(args.out, args.wheels)
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as e:
        print(f"peer_sources: {e}", file=sys.stderr)
        return 1
    print(f"wrote {len(files)} files under {args.out}; run with PYTHONPATH={args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
