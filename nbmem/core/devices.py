"""GPU presets for "would this fit on a T4?": one table, each figure with its source.

``--capacity T4`` or ``--capacity 16GiB`` both end up here. For a preset, the
capacity is the memory **PyTorch reports as the device's total**
(``torch.cuda.get_device_properties(i).total_memory``, the figure in the
out-of-memory message "GPU 0 has a total capacity of 14.75 GiB ..."), because
that, not the box's label, is the limit a real run hits. It is always less than
the vendor's figure and less than ``nvidia-smi``'s total: the driver keeps some
memory for itself, and ECC takes a share on data-centre parts.

How each figure was taken (the ``source`` of every preset says where from):

* ``source_kind="reported"``: PyTorch or driver output quoted in a public issue
  or page. Where that output gives exact bytes (``deviceQuery``), the bytes are
  used as they are. PyTorch's out-of-memory message prints GiB with two
  decimals, so those figures are ``round(gib * 2**30)`` and accurate to
  0.01 GiB. ``_CudaDeviceProperties(... total_memory=22587MB ...)`` prints whole
  MiB rounded down, so those figures are ``mib * 2**20`` and up to 1 MiB low.
* ``source_kind="nominal"``: no such output could be found; the vendor's size is
  used, read as decimal gigabytes (1 GB = 10**9 bytes, as NVIDIA's datasheets
  count). Expect the real total to be a few per cent lower.

The same GPU reports different totals under different drivers and ECC settings
(a T4 has shown 14.56 to 14.76 GiB). Where reports disagree, the table keeps
the most common figure and the comment next to it names the others.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from nbmem.core.units import format_bytes, parse_bytes

__all__ = ["DevicePreset", "PRESETS", "preset", "parse_capacity", "COMPUTE_CAPABILITY", "SM_COUNT", "threads_per_sm",
           "gpu_or_h100"]

_GIB = 2**30
_MIB = 2**20


@dataclass(frozen=True)
class DevicePreset:
    """One GPU model: the total PyTorch reports for it, and where that figure comes from.

    >>> t4 = preset("T4")
    >>> t4.capacity, t4.source_kind
    (15843721216, 'reported')
    >>> str(t4)
    'T4: 14.8 GiB as PyTorch reports it (nominal 16 GB GDDR6)'
    """

    #: Canonical name, e.g. "A100-40GB".
    name: str
    #: Bytes PyTorch reports as the device's total: what nbmem uses.
    capacity: int
    #: The vendor's figure, e.g. "40 GB HBM2".
    nominal: str
    #: URL or citation for ``capacity``.
    source: str
    #: "reported" (PyTorch or driver output quoted in the source) or "nominal".
    source_kind: Literal["reported", "nominal"]
    #: The device type PyTorch runs it as: "cuda" (NVIDIA; AMD's under ROCm too), "xpu" (Intel), "mps" (Apple).
    backend: str = "cuda"
    #: Who makes it: "NVIDIA", "AMD" (its libraries are ROCm's: MIOpen for cuDNN, hipBLAS for cuBLAS), "Intel", "Apple".
    vendor: str = "NVIDIA"

    def __str__(self) -> str:
        if self.backend == "mps":
            return (f"{self.name}: {format_bytes(self.capacity)}, the limit PyTorch puts on MPS (\"max allowed\", at "
                    f"the default high watermark ratio 1.7; {self.nominal})")
        if self.source_kind == "reported":
            return f"{self.name}: {format_bytes(self.capacity)} as PyTorch reports it (nominal {self.nominal})"
        return f"{self.name}: {format_bytes(self.capacity)}, the nominal {self.nominal} (no reported total)"


def _gib(reported: float) -> int:
    """Bytes for a total printed as GiB with two decimals (PyTorch's OOM message)."""
    return round(reported * _GIB)


_TABLE = (
    # Tesla T4. deviceQuery "Total amount of global memory: 15110 MBytes
    # (15843721216 bytes)", CUDA driver 11.0 = 14.76 GiB, the same as the
    # _CudaDeviceProperties "total_memory=15109MB" seen most often and the
    # 14.75-14.76 GiB of most T4 OOM reports (googlecolab/colabtools#3439, #3814;
    # hpcaitech/Open-Sora#697). Newer drivers (R535 and later) report about
    # 200 MiB less: 14.56-14.58 GiB (facebookresearch/tribev2#28 on Colab in 2026,
    # Zheng-Chong/CatVTON#133 on GCP, mbzuai-oryx/GeoPixel#5).
    DevicePreset(
        name="T4",
        capacity=15843721216,
        nominal="16 GB GDDR6",
        source="https://chiemon.github.io/2024/12/25/%E6%98%BE%E5%8D%A1%E4%BF%A1%E6%81%AF.html",
        source_kind="reported",
    ),
    # NVIDIA L4. No PyTorch or deviceQuery total for it could be found; the
    # nominal 24 GB is read as 24 * 10**9 bytes (22.35 GiB). nvidia-smi shows
    # 23,034 MiB (modal-labs/modal-client#2797), and PyTorch's total is always
    # below nvidia-smi's, so the real figure is likely somewhat under this one.
    DevicePreset(
        name="L4",
        capacity=24 * 10**9,
        nominal="24 GB GDDR6",
        source="NVIDIA L4 datasheet: 24 GB GDDR6 (nominal; no reported total found)",
        source_kind="nominal",
    ),
    # NVIDIA A10 (Lambda Labs): OOM "total capacty of 21.99 GiB".
    DevicePreset(
        name="A10",
        capacity=_gib(21.99),
        nominal="24 GB GDDR6",
        source="https://github.com/zai-org/CogVLM/issues/236",
        source_kind="reported",
    ),
    # NVIDIA A10G (AWS g5): _CudaDeviceProperties(name='NVIDIA A10G', ...,
    # total_memory=22587MB) = 22.06 GiB, torch 2.15.0.dev20260909+cu130. The
    # A10G "reports ~22GB" (huggingface/local-gemma#25).
    DevicePreset(
        name="A10G",
        capacity=22587 * _MIB,
        nominal="24 GB GDDR6",
        source=(
            "TorchCodec docs, 'Accelerated video decoding on GPUs with CUDA and NVDEC' "
            "(meta-pytorch/torchcodec examples/decoding/basic_cuda_example.py), rendered output: "
            "_CudaDeviceProperties(name='NVIDIA A10G', ..., total_memory=22587MB)"
        ),
        source_kind="reported",
    ),
    # Tesla V100 16GB: OOM "15.78 GiB total capacity" on a 16G V100; matches the
    # _CudaDeviceProperties(name='Tesla V100-SXM2-16GB', ..., total_memory=16160MB)
    # printed in many public notebooks (16160 MiB = 15.78 GiB).
    DevicePreset(
        name="V100-16GB",
        capacity=_gib(15.78),
        nominal="16 GB HBM2",
        source="https://github.com/kchengiva/Shift-GCN/issues/34",
        source_kind="reported",
    ),
    # Tesla V100 32GB: OOM "31.74 GiB total capacity" on a V100 32GB. Another
    # report shows 31.75 GiB (hiyouga/LlamaFactory#182, GPU not named).
    DevicePreset(
        name="V100-32GB",
        capacity=_gib(31.74),
        nominal="32 GB HBM2",
        source="https://github.com/liucongg/ChatGLM-Finetuning/issues/73",
        source_kind="reported",
    ),
    # GeForce RTX 3060 12GB: OOM "11.76 GiB total capacity". Another RTX 3060
    # report shows 11.75 GiB (Kunhao-Liu/StyleGaussian#12).
    DevicePreset(
        name="RTX-3060-12GB",
        capacity=_gib(11.76),
        nominal="12 GB GDDR6",
        source="https://github.com/TencentARC/PhotoMaker/issues/47",
        source_kind="reported",
    ),
    # GeForce RTX 3090: OOM "23.70 GiB total capacity", also in GaoLii/DSP#10
    # and xiaoxiangAQ/GAS-Net#7. Others show 23.69 GiB (JiaweiLian/AP-PA#3) and
    # 23.68 GiB (LambdaLabsML/examples#48).
    DevicePreset(
        name="RTX-3090",
        capacity=_gib(23.70),
        nominal="24 GB GDDR6X",
        source="https://github.com/Lightning-AI/lit-llama/issues/137",
        source_kind="reported",
    ),
    # GeForce RTX 4090: OOM "total capacity of 23.64 GiB", also in
    # 3DTopia/Phidias-Diffusion#8 and TMElyralab/MuseTalk#76. Others show
    # 23.65 GiB (MotrixLab/AiOS#29, TRI-ML/packnet-sfm#250) and 23.68 GiB
    # (zai-org/CogVideo#36).
    DevicePreset(
        name="RTX-4090",
        capacity=_gib(23.64),
        nominal="24 GB GDDR6X",
        source="https://github.com/ali-vilab/VGen/issues/104",
        source_kind="reported",
    ),
    # GeForce RTX 5090: OOM "total capacity of 31.37 GiB" on "a 5090 with 32GB".
    # The only report found naming the card.
    DevicePreset(
        name="RTX-5090",
        capacity=_gib(31.37),
        nominal="32 GB GDDR7",
        source="https://github.com/Wan-Video/Wan2.1/issues/465",
        source_kind="reported",
    ),
    # RTX A6000: OOM "47.54 GiB total capacity" on 2 x A6000; matches
    # _CudaDeviceProperties(name='NVIDIA RTX A6000', ..., total_memory=48676MB)
    # seen in public benchmark notes (48676 MiB = 47.54 GiB).
    DevicePreset(
        name="RTX-A6000",
        capacity=_gib(47.54),
        nominal="48 GB GDDR6",
        source="https://github.com/google-research/semivl/issues/18",
        source_kind="reported",
    ),
    # NVIDIA L40S: OOM "total capacity of 44.42 GiB" on 8 x L40S. Other setups
    # show total_memory=45589MB (44.52 GiB) and, on Windows, 44.68 GiB
    # (vladmandic/sdnext#3656, AWS G6e).
    DevicePreset(
        name="L40S",
        capacity=_gib(44.42),
        nominal="48 GB GDDR6",
        source="https://github.com/stepfun-ai/Step-Video-T2V/issues/8",
        source_kind="reported",
    ),
    # A100-SXM4-40GB: deviceQuery "40339 MBytes (42298834944 bytes)", CUDA
    # driver 12.2 = 39.39 GiB. Other A100 40GB OOMs show 39.50 GiB
    # (TianheWu/CoSeR#10), 39.56 GiB (Colab, williamyang1991/FRESCO#28) and
    # 39.59 GiB (raoyongming/DenseCLIP#52).
    DevicePreset(
        name="A100-40GB",
        capacity=42298834944,
        nominal="40 GB HBM2",
        source="https://github.com/bottlerocket-os/bottlerocket/pull/3873",
        source_kind="reported",
    ),
    # A100 80GB: OOM "total capacity of 79.25 GiB" (an A100 reporting ~79 GiB can
    # only be the 80 GB part), also in levihsu/OOTDiffusion#235. Others show
    # 79.14 GiB (lianqi1008/Control-GIC#6) and 79.35 GiB
    # (Instruction-Tuning-with-GPT-4/GPT-4-LLM#16).
    DevicePreset(
        name="A100-80GB",
        capacity=_gib(79.25),
        nominal="80 GB HBM2e",
        source="https://github.com/HiDream-ai/VAREdit/issues/6",
        source_kind="reported",
    ),
    # H100 80GB: OOM "total capacity of 79.11 GiB", also in NVIDIA-NeMo/RL#2814.
    # Other setups print total_memory=81089MB (79.19 GiB).
    DevicePreset(
        name="H100-80GB",
        capacity=_gib(79.11),
        nominal="80 GB HBM3",
        source="https://github.com/vllm-project/vllm/issues/27508",
        source_kind="reported",
    ),
    # NVIDIA H200: _CudaDeviceProperties(name='NVIDIA H200', ...,
    # total_memory=143156MB) = 139.80 GiB, quoted in a comment of this file.
    # nvidia-smi shows more, 143,771 MiB (thundergolfer.com/blog/nvidia-gpu-memory-capacity).
    DevicePreset(
        name="H200",
        capacity=143156 * _MIB,
        nominal="141 GB HBM3e",
        source=(
            "https://github.com/ai-bot-pro/achatbot/blob/859e21612de769164d8d1802d794ef8f87ace3c8/"
            "deploy/modal/src/llm/vllm/vlm/skywork_r1v.py"
        ),
        source_kind="reported",
    ),
    # Intel Arc A770 16GB, run by PyTorch as "xpu": its own OOM message, "GPU 0 has a total capacity of 15.11 GiB",
    # also in intel/intel-xpu-backend-for-triton#7477 and intel/intel-extension-for-pytorch#863.
    DevicePreset(
        name="Arc-A770-16GB",
        capacity=_gib(15.11),
        nominal="16 GB GDDR6",
        source="https://github.com/intel/intel-extension-for-pytorch/issues/846",
        source_kind="reported",
        backend="xpu",
        vendor="Intel",
    ),
    # AMD Radeon RX 9070 XT 16GB, run by PyTorch (ROCm) as "cuda": "HIP out of memory. ... GPU 0 has a total
    # capacity of 15.92 GiB" with the GPU named in the report.
    DevicePreset(
        name="RX-9070-XT",
        capacity=_gib(15.92),
        nominal="16 GB GDDR6",
        source="https://github.com/Comfy-Org/ComfyUI/issues/13112",
        source_kind="reported",
        vendor="AMD",
    ),
    # Apple silicon Macs, run as "mps". Their memory is the machine's; what PyTorch lets MPS take is its
    # allocator's limit, "max allowed" in its out-of-memory message: Metal's recommended working set times
    # PYTORCH_MPS_HIGH_WATERMARK_RATIO (1.7 by default; another ratio moves the limit). The working set is 2/3
    # of the memory up to 32 GB and 3/4 above in every report here: 16 GB * 2/3 * 1.7 = 18.13 GiB, 64 GB * 3/4 *
    # 1.7 = 81.60 GiB. A limit above the machine's memory is reached only by swapping.
    *(
        DevicePreset(
            name=f"Mac-{size}GB",
            capacity=_gib(limit),
            nominal=f"{size} GB unified memory",
            source=source,
            source_kind="reported",
            backend="mps",
            vendor="Apple",
        )
        for size, limit, source in (
            # "max allowed: 9.07 GB", its machine unnamed: 8 GiB * 2/3 * 1.7 = 9.07
            (8, 9.07, "https://github.com/datalab-to/surya/issues/254"),
            # "Macbook Pro m1 16 gb": "max allowed: 18.13 GB" (also Comfy-Org/ComfyUI#7372, #8984)
            (16, 18.13, "https://github.com/pinokiocomputer/pinokio/issues/941"),
            # "max allowed: 36.27 GB", its machine unnamed: 32 GiB * 2/3 * 1.7 = 36.27
            (32, 36.27, "https://github.com/robbyant-research/MagicQuill/issues/120"),
            # "M1 Max 64 Gb": "max allowed: 81.60 GB"
            (64, 81.60, "https://github.com/BoBo0037/bobo-fun/issues/8"),
            # "M3 MAX 128GB": "max allowed: 163.20 GiB"
            (128, 163.20, "https://github.com/Comfy-Org/ComfyUI/issues/9308"),
        )
    ),
)

#: Canonical name -> preset; read-only (see :func:`preset` for forgiving lookup).
PRESETS: Mapping[str, DevicePreset] = MappingProxyType({entry.name: entry for entry in _TABLE})

# Words users often put in front of a model name ("Tesla T4", "NVIDIA GeForce
# RTX 4090"); dropped before matching.
_BRANDS = ("nvidia", "tesla", "geforce")


def _key(name: str) -> str:
    """Lower-case, without '-', '_', spaces or a leading brand: 'RTX 4090' -> 'rtx4090'."""
    key = re.sub(r"[-_\s]+", "", name.lower())
    stripped = True
    while stripped:
        stripped = False
        for brand in _BRANDS:
            if key.startswith(brand) and len(key) > len(brand):
                key, stripped = key[len(brand) :], True
    return key


_BY_KEY: Mapping[str, DevicePreset] = MappingProxyType({_key(entry.name): entry for entry in _TABLE})


def _names() -> str:
    return ", ".join(PRESETS)


def _suggestions(name: str) -> list[str]:
    """Up to three preset names: those that begin with the input (A100 -> A100-40GB), then difflib's closest."""
    key = _key(name)
    keys = [known for known in _BY_KEY if key and known.startswith(key)]
    keys += [known for known in difflib.get_close_matches(key, list(_BY_KEY), n=3, cutoff=0.6) if known not in keys]
    return [_BY_KEY[known].name for known in keys[:3]]


def preset(name: str) -> DevicePreset:
    """The preset for a GPU name, matched ignoring case, '-', '_', spaces and "NVIDIA"/"Tesla"/"GeForce".

    >>> preset("rtx 4090").name
    'RTX-4090'
    >>> preset("A100_40gb").capacity
    42298834944
    >>> preset("A100")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
        ...
    ValueError: unknown GPU preset 'A100'. Did you mean 'A100-40GB', 'A100-80GB' or 'A10'? Known presets: T4, L4, ...
    """
    found = _BY_KEY.get(_key(name))
    if found is not None:
        return found
    raise ValueError(f"unknown GPU preset {name!r}.{_did_you_mean(name)} Known presets: {_names()}")


def _did_you_mean(name: str) -> str:
    """' Did you mean 'A100-40GB' or 'A100-80GB'?', or '' when nothing is close."""
    close = [repr(match) for match in _suggestions(name)]
    if not close:
        return ""
    listed = close[0] if len(close) == 1 else ", ".join(close[:-1]) + " or " + close[-1]
    return f" Did you mean {listed}?"


def parse_capacity(value: str | int) -> tuple[int, str]:
    """Read ``--capacity``: a size or a GPU preset -> ``(bytes, label)``.

    The label is the preset's name, or the size as written; a bare number of
    bytes is labelled in binary units, so it reads as a size (typed as text it must
    be 1 MiB or more, an int 1 KiB or more and no preset's number: "4090" or 16 is
    a GPU's name or a size in GB missing its unit). Sizes go through
    :func:`nbmem.core.units.parse_bytes`: binary units (KiB, MiB, GiB) are powers of
    1024, decimal units (KB, MB, GB) powers of 1000, a bare number is bytes.

    >>> parse_capacity("16GiB")
    (17179869184, '16GiB')
    >>> parse_capacity("1.5 GB")
    (1500000000, '1.5 GB')
    >>> parse_capacity(4194304)
    (4194304, '4.00 MiB')
    >>> parse_capacity("158437212")
    (158437212, '151 MiB')
    >>> parse_capacity("t4")
    (15843721216, 'T4')
    """
    if isinstance(value, bool):  # bool is an int; True is not a size
        raise ValueError(_unreadable(value))
    if isinstance(value, int):
        nbytes, label = value, format_bytes(value)
    else:
        text = str(value).strip()
        found = _BY_KEY.get(_key(text))
        if found is not None:
            return found.capacity, found.name
        if isinstance(value, str) and re.fullmatch(r"[0-9]*\.[0-9]+|[0-9]+\.", text):  # typed bytes are whole
            raise ValueError(f"can't read {value!r} as a capacity: a number without a unit is bytes, and bytes are "
                             f"whole; give a unit, e.g. '{text}GiB' or '{text}GB'")
        try:
            nbytes = parse_bytes(text)
        except ValueError:
            raise ValueError(_unreadable(value)) from None
        label = format_bytes(nbytes) if text.isdigit() else text
    if nbytes <= 0:
        raise ValueError(f"a capacity must be more than 0 bytes, got {value!r}")
    text = str(value).strip()
    bare = isinstance(value, int) or text.isdigit()  # a number without a unit
    hint = _did_you_mean(text) if bare and nbytes < _SMALLEST_BARE else ""
    # "4090", 16 or 80: a GPU's model number or a size in GB, which a number without a unit would make bytes. A
    # number typed as text is refused under 1 MiB; one from code (an int: sizes nbmem itself passes on, a test's tiny
    # device) only under 1 KiB or where it names a preset
    if bare and ((nbytes < 1024 or bool(hint)) if isinstance(value, int) else nbytes < _SMALLEST_BARE):
        fix = (" Give a GPU preset, or a size with its unit such as '24GiB'" if hint else
               f" Give a size with its unit, e.g. '{text}GiB' or '{text}GB', or a GPU preset")
        raise ValueError(f"a capacity of {value!r} without a unit would be {nbytes} bytes, surely not meant."
                         f"{hint}{fix} (presets: {_names()})")
    return nbytes, label


#: A capacity typed as a bare number of bytes must be at least this (1 MiB): below it, a unit or a name was meant
_SMALLEST_BARE = 1 << 20


def _unreadable(value: object) -> str:
    hint = _did_you_mean(value) if isinstance(value, str) else ""
    return (
        f"can't read {value!r} as a capacity.{hint} Write a size such as '16GiB', '512 MiB', "
        f"'1.5GB' or 4096 (bytes), or a GPU preset: {_names()}"
    )


#: Each preset's CUDA compute capability (NVIDIA's tables): what decides the defaults PyTorch picks per GPU, such as
#: the cuBLAS workspace (32 MiB on 9.0, Hopper).
COMPUTE_CAPABILITY = MappingProxyType({
    "T4": (7, 5), "L4": (8, 9), "A10": (8, 6), "A10G": (8, 6), "V100-16GB": (7, 0), "V100-32GB": (7, 0),
    "RTX-3060-12GB": (8, 6), "RTX-3090": (8, 6), "RTX-4090": (8, 9), "RTX-5090": (12, 0), "RTX-A6000": (8, 6),
    "L40S": (8, 9), "A100-40GB": (8, 0), "A100-80GB": (8, 0), "H100-80GB": (9, 0), "H200": (9, 0),
})

#: Each preset's streaming multiprocessors (NVIDIA's specifications; H100-80GB is the SXM part, 132, as the H100 lent
#: to this project reported): bitsandbytes' 4-bit matmul chooses its kernel by them (nbmem.estimation.quantized_kernels).
SM_COUNT = MappingProxyType({
    "T4": 40, "L4": 58, "A10": 72, "A10G": 80, "V100-16GB": 80, "V100-32GB": 80, "RTX-3060-12GB": 28, "RTX-3090": 82,
    "RTX-4090": 128, "RTX-5090": 170, "RTX-A6000": 84, "L40S": 142, "A100-40GB": 108, "A100-80GB": 108,
    "H100-80GB": 132, "H200": 132,
})

#: resident threads per SM where it is not 2,048 (CUDA's occupancy tables: Turing 1,024; Ampere's GA10x, Ada and
#: consumer Blackwell 1,536)
_THREADS_PER_SM = MappingProxyType({(7, 5): 1024, (8, 6): 1536, (8, 7): 1536, (8, 9): 1536, (12, 0): 1536})


def threads_per_sm(device_label: str) -> int:
    """Resident threads per SM of the NVIDIA GPU preset ``device_label`` (what kernels' launch rules size grids by).

    >>> threads_per_sm("H100-80GB"), threads_per_sm("RTX-4090"), threads_per_sm("T4")
    (2048, 1536, 1024)
    """
    return _THREADS_PER_SM.get(COMPUTE_CAPABILITY[device_label], 2048)


def gpu_or_h100(device_label: str | None) -> str:
    """The preset whose SM count and compute capability stand for the GPU ``device_label`` names: its own where
    nbmem knows them, the H100's (where nbmem's CUDA figures were measured) for none or an unknown one.

    >>> gpu_or_h100("T4"), gpu_or_h100(None), gpu_or_h100("Mac-16GB")
    ('T4', 'H100-80GB', 'H100-80GB')
    """
    return device_label if device_label is not None and device_label in SM_COUNT else "H100-80GB"
