"""The GPUs kvbuffer knows: arch (TileLang target), SM count, memory bandwidth, L2 size.

Runtime side: the artifact lookup names the local GPU's tuning record with `detect_local_gpu`, and
a JIT compile targets the local compute capability (`local_target`); `kvbuffer tune --gpu` builds
for a named one. Imports neither TileLang nor (at module import) torch.

Only GPUs TileLang 0.1.15 can target honestly are listed; every arch here compiles kvbuffer's
GDN templates with nvcc 13.0 (checked on a CPU machine: sm_80, sm_89, sm_90a, sm_100a). Hopper
and Blackwell need the arch-specific targets (sm_90a, sm_100a): plain sm_90 fails TileLang's
static_assert on warpgroup register reconfiguration. The numbers are the vendors' datasheet values
for the named SKU; on a present GPU, `detect_local_gpu` takes SM count, memory and L2 from the
driver instead. Bandwidth only scales reports (achieved / peak); tuning measures, it never
predicts from these numbers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from .errors import DeviceError


@dataclass(frozen=True)
class GPU:
    name: str                 # kvbuffer's short name, used in cache keys and `--gpu`
    product: str              # the SKU the numbers are for
    arch: str                 # TileLang/nvcc target arch
    sm_count: int
    mem_bandwidth_gbs: float  # peak DRAM bandwidth, GB/s (10^9)
    l2_mib: float
    memory_gib: float
    pattern: str = ""         # regex on torch.cuda.get_device_name() that identifies it

    @property
    def target(self) -> dict:
        """The TileLang target dict (string targets are rejected by TileLang 0.1.15)."""
        return {"kind": "cuda", "arch": self.arch}

    @property
    def compute_capability(self) -> tuple[int, int]:
        n = int(re.fullmatch(r"sm_(\d+)[a-z]?", self.arch).group(1))
        return n // 10, n % 10


# Order matters for detection: more specific patterns first (L40S before L4, H100 PCIe before H100).
CATALOGUE: tuple[GPU, ...] = (
    GPU("a100", "A100 SXM4 80GB", "sm_80", 108, 2039, 40, 80, r"A100"),
    GPU("a10g", "A10G 24GB", "sm_86", 80, 600, 6, 24, r"A10G"),
    GPU("l40s", "L40S 48GB", "sm_89", 142, 864, 96, 48, r"L40S"),
    GPU("l4", "L4 24GB", "sm_89", 58, 300, 48, 24, r"\bL4\b"),
    GPU("h100-pcie", "H100 PCIe 80GB", "sm_90a", 114, 2039, 50, 80, r"H100.*PCIe"),
    GPU("h100", "H100 SXM5 80GB", "sm_90a", 132, 3352, 50, 80, r"H100"),
    GPU("h200", "H200 SXM 141GB", "sm_90a", 132, 4800, 50, 141, r"H200"),
    GPU("b200", "B200 180GB", "sm_100a", 148, 8000, 126, 180, r"B200"),
)

ARCH_FOR_CAPABILITY = {(8, 0): "sm_80", (8, 6): "sm_86", (8, 9): "sm_89", (9, 0): "sm_90a", (10, 0): "sm_100a"}


def arch_for_capability(capability: tuple[int, int], device_name: str = "this GPU") -> str:
    """The TileLang arch for a compute capability; DeviceError for one the templates are not built for."""
    cc = tuple(capability)
    if cc not in ARCH_FOR_CAPABILITY:
        raise DeviceError(f"{device_name} (compute capability {cc[0]}.{cc[1]}) has no TileLang target in "
                          f"kvbuffer's catalogue; supported: {sorted(set(ARCH_FOR_CAPABILITY.values()))}")
    return ARCH_FOR_CAPABILITY[cc]


def local_target(device: int = 0) -> dict:
    """The TileLang target dict for the CUDA device torch sees (what a JIT compile builds for)."""
    import torch

    if not torch.cuda.is_available():
        raise DeviceError("JIT compiling needs a CUDA GPU: the kernels are built for the local device's arch")
    cc = torch.cuda.get_device_capability(device)
    return {"kind": "cuda", "arch": arch_for_capability(cc, torch.cuda.get_device_name(device))}


def gpu_names() -> list[str]:
    return [g.name for g in CATALOGUE]


def get_gpu(name: str) -> GPU:
    """Look a GPU up by its short name (case-insensitive); ValueError lists the known names."""
    for gpu in CATALOGUE:
        if gpu.name == name.lower():
            return gpu
    raise ValueError(f"unknown GPU {name!r}; known: {', '.join(gpu_names())} (`kvbuffer tune --list-gpus`)")


def match_device(device_name: str, capability: tuple[int, int]) -> GPU | None:
    """The catalogue entry for a driver-reported device name, if its compute capability agrees."""
    for gpu in CATALOGUE:
        if re.search(gpu.pattern, device_name) and gpu.compute_capability == tuple(capability):
            return gpu
    return None


def detect_local_gpu(device: int = 0) -> GPU | None:
    """The GPU torch sees (None without CUDA), with SM count, memory and L2 read from the driver.

    An unlisted model of a supported compute capability gets a name derived from the device name;
    an unsupported compute capability raises DeviceError (TileLang 0.1.15 has no target for it here).
    """
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(device)
    cc = (props.major, props.minor)
    base = match_device(props.name, cc)
    if base is None:
        arch = arch_for_capability(cc, props.name)
        slug = re.sub(r"[^a-z0-9]+", "-", props.name.lower().replace("nvidia", "")).strip("-")
        base = GPU(slug, props.name, arch, props.multi_processor_count, 0.0, 0.0, 0.0)
    l2 = getattr(props, "L2_cache_size", 0) / 2**20 or base.l2_mib
    return replace(base, sm_count=props.multi_processor_count, l2_mib=l2,
                   memory_gib=round(props.total_memory / 2**30, 1))


def catalogue_table() -> list[tuple[str, ...]]:
    """Rows for `kvbuffer tune --list-gpus` (header first)."""
    rows = [("name", "product", "arch", "SMs", "GB/s", "L2 MiB", "memory GiB")]
    rows += [(g.name, g.product, g.arch, str(g.sm_count), f"{g.mem_bandwidth_gbs:g}", f"{g.l2_mib:g}",
              f"{g.memory_gib:g}") for g in CATALOGUE]
    return rows
