"""Host side of TMA: tensor maps (CUtensorMap) for the Hopper kernels, encoded once per layout.

A tensor map describes a global tensor (dims innermost first, byte strides) and the box one TMA
load copies into shared memory, with the swizzle wgmma expects. The attention operands, (batch,
seqlen, heads, head_dim) with free strides, become rank-5 maps {panel, seqlen, head_dim / panel,
heads, batch}: a panel is the 64 (128B swizzle) or 32 (64B swizzle) head_dim columns one swizzled
shared-memory row holds, and the box {panel, rows, head_dim / panel, 1, 1} writes a whole tile as
consecutive panels in one instruction (ThunderKittens' layout); an fp32 panel
(the backward's dQ accumulator) is 32 columns at 128B swizzle. Rows past the tensor's end are
zero-filled by a load and left alone by a store (the output's map, box {panel, rows, 1, 1, 1}). Building a `TiledMap` needs no driver (tests check it on CPU); `encode` calls
cuTensorMapEncodeTiled once per layout and address, and once the driver's maps are seen to hold
the address in their first word, a new address of a known layout is patched in, not encoded.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

ELEMENT_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}  # fp32: the backward's dQ accumulator
DTYPES = tuple(ELEMENT_BYTES)
SWIZZLES = (64, 128)  # bytes per shared-memory row of a panel
MAX_BOX = 256         # elements per box dimension
MAP_BYTES = 128


@dataclass(frozen=True)
class TiledMap:
    """Every argument of cuTensorMapEncodeTiled except the global address."""
    dtype: str                   # "fp16" | "bf16" | "fp32"
    dims: tuple[int, ...]        # elements per dimension, innermost first
    strides: tuple[int, ...]     # bytes between consecutive indices of dims[1:]
    box: tuple[int, ...]         # elements one load copies per dimension
    swizzle: int                 # 64 | 128


def attention_map(shape, strides, dtype: str, rows: int, swizzle: int,
                  panels: int | None = None) -> TiledMap:
    """The map of a (batch, seqlen, heads, head_dim) tensor whose element strides are `strides`,
    loaded `rows` sequence positions (of one batch and head, every column) at a time; or, with
    `panels`, that many panels of them per box (a TMA store of one warpgroup's rows, whose panels
    are not adjacent in shared memory, copies one panel at a time)."""
    batch, seqlen, heads, head_dim = (int(n) for n in shape)
    stride_b, stride_s, stride_h, stride_d = (int(s) for s in strides)
    if dtype not in DTYPES:
        raise ValueError(f"tensor maps take dtype {DTYPES}, got {dtype!r}")
    if swizzle not in SWIZZLES:
        raise ValueError(f"swizzle must be one of {SWIZZLES} bytes, got {swizzle}")
    element = ELEMENT_BYTES[dtype]
    panel = swizzle // element
    if head_dim % panel:
        raise ValueError(f"head_dim {head_dim} is not a multiple of the {panel}-column panel "
                         f"of {swizzle}B swizzle")
    if stride_d != 1 and head_dim > 1:
        raise ValueError(f"head_dim must be contiguous (stride 1), got stride {stride_d}")
    byte_strides = (stride_s * element, swizzle, stride_h * element, stride_b * element)
    for name, value in zip(("seqlen", "heads", "batch"), byte_strides[::2]):
        if value % 16 or not 0 <= value < 2**40:
            raise ValueError(f"the {name} stride must be a multiple of 16 bytes below 2^40, "
                             f"got {value} bytes")
    if not 0 < rows <= MAX_BOX:
        raise ValueError(f"a box holds 1..{MAX_BOX} rows, got {rows}")
    panels = head_dim // panel if panels is None else panels
    if not 0 < panels <= head_dim // panel:
        raise ValueError(f"a box holds 1..{head_dim // panel} panels of head_dim {head_dim}, "
                         f"got {panels}")
    # A map dimension cannot be empty; a kernel never loads from an empty tensor.
    dims = (panel, max(seqlen, 1), head_dim // panel, max(heads, 1), max(batch, 1))
    return TiledMap(dtype, dims, byte_strides, (panel, rows, panels, 1, 1), swizzle)


_CACHE: dict[tuple[TiledMap, int], bytes] = {}
_TEMPLATES: dict[TiledMap, tuple[int, bytes]] = {}   # layout -> its first (address, map)
# Whether a map for a new address is its layout's first map with the address word (bytes 0..7,
# little-endian) replaced. The map's format is the driver's and undocumented, so this is not
# assumed: it is decided on the first address change of a layout, by encoding that map too and
# comparing. True saves a cuTensorMapEncodeTiled per operand and call (about 20 us through
# cuda.bindings on the H200) when a training step's tensors move.
_PATCHABLE: bool | None = None
_MAX_CACHED = 4096
_LOCK = threading.Lock()


def _with_address(template: bytes, address: int) -> bytes:
    return address.to_bytes(8, "little") + template[8:]


def encode(tiled: TiledMap, address: int) -> bytes:
    """The 128 bytes of the tensor map for `tiled` at device address `address` (needs a driver)."""
    global _PATCHABLE
    template = _TEMPLATES.get(tiled)
    if template is not None and _PATCHABLE and address != template[0]:
        if address % 16:
            raise ValueError(f"a tensor map needs a 16-byte aligned address, got {address:#x}")
        return _with_address(template[1], address)
    key = (tiled, address)
    found = _CACHE.get(key)
    if found is None:
        found = _encode(tiled, address)
        with _LOCK:
            if len(_CACHE) >= _MAX_CACHED:
                _CACHE.clear()
                _TEMPLATES.clear()
            if template is None:
                _TEMPLATES[tiled] = (address, found)
            elif _PATCHABLE is None:
                _PATCHABLE = (int.from_bytes(template[1][:8], "little") == template[0]
                              and _with_address(template[1], address) == found)
            _CACHE[key] = found
    return found


def encode_arguments(tiled: TiledMap, address: int) -> tuple:
    """The arguments of cuda.bindings' cuTensorMapEncodeTiled, in its types (no driver needed)."""
    if address % 16:
        raise ValueError(f"a tensor map needs a 16-byte aligned address, got {address:#x}")
    from cuda.bindings import driver

    u64, u32, rank = driver.cuuint64_t, driver.cuuint32_t, len(tiled.dims)
    dtype = {"fp16": driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
             "bf16": driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
             "fp32": driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT32}[tiled.dtype]
    swizzle = {64: driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_64B,
               128: driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B}[tiled.swizzle]
    return (dtype, rank, address, [u64(d) for d in tiled.dims], [u64(s) for s in tiled.strides],
            [u32(b) for b in tiled.box], [u32(1)] * rank,
            driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
            driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            # NONE fills out-of-bound elements with zeros (NAN_REQUEST_ZERO_FMA would give NaN).
            driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)


def _encode(tiled: TiledMap, address: int) -> bytes:
    from kernelgen.launch import _check, _driver

    arguments = encode_arguments(tiled, address)
    driver = _driver()  # cuInit, or a clear error without a driver
    tensor_map = _check(driver, driver.cuTensorMapEncodeTiled(*arguments),
                        f"cuTensorMapEncodeTiled({tiled}, address={address:#x})")
    return b"".join(int(word).to_bytes(8, "little") for word in tensor_map.opaque)
