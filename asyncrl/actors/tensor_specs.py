"""What an actor checks before an in-place weight reload touches its model: names, shapes and dtypes.

vLLM's layerwise reload (``initialize_layerwise_reload``) moves every layer's tensors to the meta
device before the first new tensor arrives, and ``load_weights`` copies each tensor into a parameter
of the served shape. A tensor of another shape (an embedding of 9 rows for 8) raises inside that copy,
after earlier layers were already replaced: the engine then generates on a half-reloaded model. So
every tensor's shape (and dtype) is compared with the served checkpoint's before the reload starts,
from safetensors headers only (no tensor data is read), and for NCCL from what the learner announces
for the round.

Dtypes: a floating-point tensor may arrive in another floating-point dtype of 16 bits or more (the
learner publishes ``model.dtype``, e.g. float32 against a bfloat16 checkpoint): vLLM casts floats to
the served dtype on every load, the first one from the checkpoint included, so that is what serving
that checkpoint already means. Any other dtype change (integer buffers, 8-bit floats) is refused.

Imports neither vLLM nor torch: the worker extension, the NCCL receiver and tests use it alike.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

__all__ = [
    "TensorSpec", "TIED_OK", "checkpoint_specs", "handle_spec", "check_names", "check_specs", "check_files",
    "open_checked",
]  # fmt: skip

#: (shape, torch dtype name without "torch.") of one tensor: vLLM's NCCL wire format for dtypes.
TensorSpec = tuple[tuple[int, ...], str]
#: A tied lm_head is saved by some trainers and skipped by vLLM: extra, never an error.
TIED_OK = frozenset({"lm_head.weight"})

# safetensors header dtype -> torch dtype name
_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}  # fmt: skip
_CASTABLE = frozenset({"float64", "float32", "float16", "bfloat16"})


def handle_spec(fh: Any, name: str) -> TensorSpec:
    """``name``'s spec in an open safetensors handle, from its header (no data read)."""
    sl = fh.get_slice(name)
    dtype = sl.get_dtype()
    return tuple(int(d) for d in sl.get_shape()), _DTYPES.get(dtype, dtype)


def checkpoint_specs(model_dir: str | Path) -> dict[str, TensorSpec]:
    """name -> spec of every tensor of the safetensors checkpoint the engine was started from."""
    from safetensors import safe_open

    specs: dict[str, TensorSpec] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            specs.update((name, handle_spec(fh, name)) for name in fh.keys())
    return specs


def _dtype_ok(want: str, got: str) -> bool:
    return want == got or (want in _CASTABLE and got in _CASTABLE)


def check_specs(expected: Mapping[str, TensorSpec], got: Mapping[str, TensorSpec]) -> str:
    """'' if every tensor of ``got`` that the checkpoint has matches its shape and dtype, else why not
    (names are checked separately: a missing or unexpected name is not reported here)."""
    bad = []
    for name in sorted(got.keys() & expected.keys()):
        (want_shape, want_dtype), (shape, dtype) = expected[name], got[name]
        if tuple(shape) != tuple(want_shape) or not _dtype_ok(want_dtype, dtype):
            bad.append(f"{name}: {list(shape)} {dtype}, served {list(want_shape)} {want_dtype}")
    if not bad:
        return ""
    more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
    return f"tensor shapes/dtypes do not match the served model: {'; '.join(bad[:3])}{more}"


def check_names(expected: Mapping[str, Any] | set[str], names: Sequence[str]) -> str:
    """'' if ``names`` are exactly the served checkpoint's tensors (a tied lm_head may be extra), else why not."""
    got = set(names)
    if len(got) != len(names):
        return f"duplicate tensor names {sorted(n for n, c in Counter(names).items() if c > 1)[:5]}"
    missing, extra = sorted(set(expected) - got), sorted(got - set(expected) - TIED_OK)
    if missing or extra:
        return (
            f"tensor names do not match the served model "
            f"(missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {extra[:5]}{'...' if len(extra) > 5 else ''})"
        )
    return ""


def check_files(
    p: Path, files: list[Path], handles: list[Any], version: int, expected: Mapping[str, TensorSpec]
) -> dict[str, Any]:
    """name -> open safetensors handle of ``files`` (``p``'s), or ValueError, checking that: there are
    files; each is tagged ``version`` (``asyncrl_version`` metadata; untagged files were not written by
    asyncrl and pass; ``version`` < 0 checks nothing); no name is in two files (which one would load
    depends on the order: refused, not guessed); the names are the served checkpoint's; and each
    tensor has its shape and dtype (see the module doc). ``expected`` empty: nothing to compare with."""
    if not files:
        raise ValueError(f"{p}: no safetensors files")
    if version >= 0:
        for f, fh in zip(files, handles, strict=True):
            tag = (fh.metadata() or {}).get("asyncrl_version")
            if tag is not None and tag != str(version):
                raise ValueError(f"{f}: holds version {tag!r}, expected {version}")
    owner: dict[str, Any] = {}
    where: dict[str, Path] = {}
    for f, fh in zip(files, handles, strict=True):
        for name in fh.keys():
            if name in owner:
                raise ValueError(f"{p}: tensor {name!r} is in both {where[name].name} and {f.name}")
            owner[name], where[name] = fh, f
    if expected:
        why = check_names(expected, list(owner)) or check_specs(
            expected, {name: handle_spec(fh, name) for name, fh in owner.items() if name in expected}
        )
        if why:
            raise ValueError(f"{p}: {why}")
    return owner


def open_checked(
    path: str | Path, version: int, stack: ExitStack, expected: Mapping[str, TensorSpec]
) -> dict[str, Any]:
    """name -> open safetensors handle (closed with ``stack``) of the file ``path``, or of every
    ``*.safetensors`` in the directory ``path``, after :func:`check_files`."""
    from safetensors import safe_open

    p = Path(path)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    handles = [stack.enter_context(safe_open(str(f), framework="pt")) for f in files]
    return check_files(p, files, handles, version, expected)
