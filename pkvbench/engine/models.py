"""Model loading: aliases, the embedded GGUF model and its float cache, architecture checks."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.metadata
import io
import logging
import os
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from types import SimpleNamespace

from pkvbench.cell.kv_formats import CacheGeometry, KVFormat
from pkvbench.cell.models import ALIASES, DEFAULT_MODEL, DEVICES, DTYPES, GGUFAlias, placement_of
from pkvbench.engine.architecture import Architecture, check_family
from pkvbench.errors import PkvError, first_line
from pkvbench.io import read_json

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelShape:
    """What a model's config says of its cache (no weights needed): what every check of a storage format or a memory
    budget reads, before the model loads; once it has loaded, the engine's measured geometry (``Engine.shape``)."""

    geometry: CacheGeometry  # its layers of per-token entries; a hybrid's state is not known before it loads (None)
    query_heads: int
    bits: int  # the width the model computes in: its own cache's values
    architecture: Architecture  # what its layers do (``Architecture.read``)

    @classmethod
    def of(cls, bits: int, architecture: Architecture) -> ModelShape:
        """From the width the model computes in and what its layers do, read from the model's code: each attention
        layer's cache as the model writes it (an MLA latent's one head), a hybrid's state not yet known."""
        state = None if architecture.state_layers else 0
        return cls(CacheGeometry(architecture.cache_shapes, state), architecture.query_heads, bits, architecture)

    @property
    def latent(self) -> bool:
        """An MLA latent per token (``engine/latent.py``)."""
        return self.architecture.latent

    @property
    def native_format(self) -> KVFormat:
        return KVFormat(self.bits, native=True)


@dataclass
class LoadedModel:
    model: object
    tokenizer: object
    name: str
    device: str
    dtype: str
    attn_implementation: str
    load_s: float
    source: str
    info: dict = field(default_factory=dict)
    architecture: Architecture | None = None  # read before the weights loaded (``Architecture.read``)
    placement: dict | None = None  # where accelerate placed each module (``placement.describe``); None: on ``device``

    @property
    def config(self):
        return self.model.config

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        return self.config.num_key_value_heads

    @property
    def num_query_heads(self) -> int:
        return self.config.num_attention_heads

    @property
    def head_dim(self) -> int:
        return getattr(self.config, "head_dim", None) or self.config.hidden_size // self.config.num_attention_heads

    @property
    def bits(self) -> int:
        """The width it computes in: its own cache's values."""
        return 32 if self.dtype == "float32" else 16

    def _cache_heads(self) -> dict:
        """The heads and key size of each attention layer's cache, as the model writes it (an MLA latent's one head):
        one value where every layer has it, else a list per attention layer (Gemma 4's local and global differ)."""
        if self.architecture is None or not self.architecture.cache_shapes:
            return {"kv_heads": self.num_kv_heads, "head_dim": self.head_dim}
        shapes = self.architecture.cache_shapes

        def per_layer(values: list[int]) -> int | list[int]:
            return values[0] if len(set(values)) == 1 else values

        return {"kv_heads": per_layer([s.heads for s in shapes]), "head_dim": per_layer([s.key_dim for s in shapes])}

    def describe(self) -> dict:
        """What a run records about its model (run.json's ``model``)."""
        return {
            "name": self.name,
            "source": self.source,
            "device": self.device,
            "dtype": self.dtype,
            "layers": self.num_layers,
            **self._cache_heads(),
            "attention": self.attn_implementation,  # the kernel it ran on (eager for a soft-capped model)
            **({"device_map": self.placement} if self.placement is not None else {}),
        }


def cache_root() -> Path:
    root = os.environ.get("PKVBENCH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "pkvbench"
    )
    return Path(root)


def locate_gguf(alias: GGUFAlias) -> Path:
    try:
        dist = importlib.metadata.distribution(alias.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise PkvError(f"the model needs the PyPI package {alias.distribution}: {alias.install_hint}") from None
    if dist.version != alias.version:
        raise PkvError(f"found {alias.distribution} {dist.version}, need {alias.version}: {alias.install_hint}")
    path = Path(str(dist.locate_file(alias.folder))) / alias.filename
    if not path.is_file():
        raise PkvError(f"{alias.distribution} is installed but {path} is missing; reinstall: {alias.install_hint}")
    return path


# GGUF's ``general.architecture`` names of the architectures above (Mistral models are written as "llama").
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
UNQUANTIZED_GGUF_TYPES = ("F32", "F16")


@dataclass(frozen=True)
class GGUFHeader:
    """What pkvbench reads of a GGUF file before loading it."""

    architecture: str | None  # general.architecture
    context_length: int | None  # <architecture>.context_length
    tensor_types: frozenset[str]  # the quantizations its tensors are stored in


@cache
def _read_gguf_header(path: str, size: int, mtime_ns: int) -> GGUFHeader:
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError, KeyError) as exc:
        raise PkvError(f"{path} is not a readable GGUF file: {first_line(exc)}") from None

    def value(name: str):
        field = reader.fields.get(name)
        return field.parts[field.data[0]] if field is not None and field.data else None

    architecture = value("general.architecture")
    architecture = bytes(architecture).decode("utf-8", "replace") if architecture is not None else None
    length = value(f"{architecture}.context_length") if architecture is not None else None
    return GGUFHeader(
        architecture,
        int(length[0]) if length is not None else None,
        frozenset(t.tensor_type.name for t in reader.tensors),
    )


def gguf_header(path: Path) -> GGUFHeader:
    """A GGUF file's header, without de-quantizing its weights. Parsing still takes a second or two (gguf-py reads
    every field, the tokenizer's vocabulary included), so it is read once per file version."""
    stat = path.stat()
    return _read_gguf_header(str(path), stat.st_size, stat.st_mtime_ns)


def check_gguf_file(path: Path) -> None:
    """Refuse, in one line and before any slow work, a GGUF file of an architecture or quantization we cannot load."""
    from gguf.quants import _type_traits as dequantizable  # gguf-py's table of quantizations it can de-quantize

    header = gguf_header(path)
    if header.architecture not in GGUF_ARCHITECTURES:
        raise PkvError(
            f"{path} holds a {header.architecture!r} model; supported GGUF architectures: "
            f"{', '.join(GGUF_ARCHITECTURES)}"
        )
    known = set(UNQUANTIZED_GGUF_TYPES) | {kind.name for kind in dequantizable}
    unknown = sorted(header.tensor_types - known)
    if unknown:
        raise PkvError(
            f"{path} uses the quantization {', '.join(unknown)}, which cannot be de-quantized; supported: "
            f"{', '.join(sorted(known))}"
        )


def local_gguf_cache_name(path: Path) -> str:
    """The float copy of a local GGUF file is keyed by its path, size and modification time: a changed file is
    de-quantized again."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return f"gguf-{path.stem}-{key}-float32"


def _is_saved_model(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def float_copy_of_gguf(gguf: Path, cache_name: str) -> Path:
    """A float32 safetensors copy of a GGUF model, made once under the pkvbench cache.

    transformers de-quantizes GGUF tensors on every load (about 24 s for SmolLM2-135M on 2 CPU cores, against 0.5 s
    for the saved copy), so the first load writes the result under the pkvbench cache and later loads read that.
    """
    target = cache_root() / "models" / cache_name
    if _is_saved_model(target):
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("de-quantizing %s once into %s", gguf.name, target)
    if sys.stderr.isatty():  # a person waits: say why, in one line (transformers' own bar is kept off stderr)
        print(f"pkvbench: de-quantizing {gguf.name} once into {target} (a minute or so)", file=sys.stderr)
    try:
        # transformers draws a tqdm bar over the tensors on stderr, outside its own progress-bar switch; on a
        # clean machine it would bury the one line an error or a run prints.
        with contextlib.redirect_stderr(io.StringIO()):
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except (OSError, ValueError, NotImplementedError, KeyError) as exc:
        raise PkvError(f"could not de-quantize {gguf}: {first_line(exc)}") from None
    # The weights are now plain floats; drop the GGUF quantization record so transformers will save them.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    staging = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if not _is_saved_model(target):  # another process may have made it meanwhile: never delete a copy in use
            shutil.rmtree(target, ignore_errors=True)  # what an older, interrupted layout left
            staging.rename(target)  # atomic: an interrupted conversion never leaves a half-written model behind
    except OSError as exc:
        if _is_saved_model(target):  # the other process's rename won the race: its copy is the same model
            return target
        raise PkvError(f"cannot write the de-quantized model to {target}: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve_device(device: str) -> str:
    import torch

    if device not in DEVICES:
        raise PkvError(f"unknown device {device!r}; valid: {', '.join(DEVICES)}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise PkvError("--device cuda: no CUDA device is available (use --device cpu)")
    return device


def resolve_dtype(dtype: str, device: str) -> str:
    if dtype not in DTYPES:
        raise PkvError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPES)}")
    if dtype == "auto":
        return "float32" if device == "cpu" else "bfloat16"
    return dtype


def check_architecture(config, name: str) -> None:
    check_family(config, name)


# Architectures read in this process, by config (its JSON), model name and weights folder: read once each.
_ARCHITECTURES: dict[tuple[str, str, str | None], Architecture] = {}


def read_architecture(config, name: str, folder: str | None = None) -> Architecture:
    """What ``config``'s model does, read from its code before its weights load (``Architecture.read``: refuses
    what it cannot compute or pkvbench cannot run exactly, in one line); ``folder``: where its weights are, whose
    shapes must be the config's. Read once per config."""
    weights = folder if folder and any(Path(folder).glob("*.safetensors")) else None
    key = (config.to_json_string(use_diff=False), name, weights)
    if key not in _ARCHITECTURES:
        _ARCHITECTURES[key] = Architecture.read(copy.deepcopy(config), name, Path(weights) if weights else None)
    return _ARCHITECTURES[key]


def _transformers_config(path: Path, name: str):
    """The transformers config of a ``config.json`` (its family already admitted): transformers' own checks of its
    values, refused in one line."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path.parent))
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise PkvError(f"model {name}: its config is not valid: {first_line(exc)}") from None


def is_gguf_file(name: str) -> bool:
    return name.lower().endswith(".gguf")


def check_model_name(name: str) -> None:
    """Cheap check before anything slow: an alias, a local folder or GGUF file, or something shaped like a hub id."""
    if is_gguf_file(name):
        if not os.path.isfile(name):
            raise PkvError(f"--model {name}: no such GGUF file")
        check_gguf_file(Path(name))
        return
    if name not in ALIASES and not os.path.isdir(name) and "/" not in name:
        raise PkvError(
            f"unknown model {name!r}; use an alias ({', '.join(ALIASES)}), a Hugging Face model id (org/name), a "
            "local folder or a .gguf file"
        )


def float_copy_name(name: str) -> str | None:
    """The folder name (under the pkvbench cache) of an alias's or a GGUF file's float copy; None for other models."""
    if name in ALIASES:
        alias = ALIASES[name]
        return f"{name}-{alias.distribution}-{alias.version}-float32"
    return local_gguf_cache_name(Path(name)) if is_gguf_file(name) and os.path.isfile(name) else None


def cached_float_copy(name: str) -> Path | None:
    """The float copy of an alias or a GGUF file if it has been made, without making it (or reading the GGUF)."""
    cache_name = float_copy_name(name)
    if cache_name is None:
        return None
    target = cache_root() / "models" / cache_name
    return target if _is_saved_model(target) else None


def model_path(name: str) -> tuple[str, str]:
    """Where ``name`` loads from (a folder or a hub id) and what run.json calls its source."""
    if name in ALIASES:
        alias = ALIASES[name]
        folder = float_copy_of_gguf(locate_gguf(alias), float_copy_name(name))
        return str(folder), f"{alias.distribution}=={alias.version}"
    if is_gguf_file(name):
        path = Path(name)
        return str(float_copy_of_gguf(path, float_copy_name(name))), str(path.resolve())
    return name, name


@cache
def _tokenizer(path: str):
    """A folder's tokenizer, parsed once per process: a run builds its samples with it before the model loads, and
    ``load_model`` returns the same object rather than parsing ``tokenizer.json`` again (0.2 s of every start-up).
    Nothing in pkvbench changes a tokenizer's settings, so sharing it is safe."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def load_tokenizer(name: str = DEFAULT_MODEL):
    """The model's tokenizer alone (what building samples needs), the same one ``load_model`` returns."""
    check_model_name(name)
    try:
        return _tokenizer(model_path(name)[0])
    except (OSError, ValueError, ImportError) as exc:
        raise PkvError(f"could not load the tokenizer of {name}: {first_line(exc)}") from None


def kernel_of_family(config, architecture: Architecture, requested: str) -> str:
    """The attention kernel to load the model with: ``requested``, but eager where it is sdpa and the model
    soft-caps its logits (``Architecture.attention_kernel``) or its family has no sdpa kernel (gpt-oss, whose sinks
    only its eager kernel adds); the stock reference runs on the same one (``exactness.stock_attention``)."""
    from transformers import AutoModelForCausalLM

    requested = architecture.attention_kernel(requested)
    model_class = AutoModelForCausalLM._model_mapping.get(type(config), None)
    if requested == "sdpa" and model_class is not None and not getattr(model_class, "_supports_sdpa", True):
        return "eager"
    return requested


def load_model(
    name: str = DEFAULT_MODEL,
    *,
    device: str = "auto",
    dtype: str = "auto",
    attn_implementation: str = "sdpa",
    device_map: str | os.PathLike | Mapping | None = None,
    max_memory: Mapping | Sequence[str] = (),
    offload_folder: str | os.PathLike | None = None,
) -> LoadedModel:
    """Load an alias, a Hugging Face hub id or a local folder, ready for the engine: on ``device``, or placed over
    several devices (and the CPU or the disk) by accelerate as ``device_map``, ``max_memory`` and ``offload_folder``
    say (``cell.models.placement_of``, ``engine/placement.py``)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pkvbench.engine import placement as placing
    from pkvbench.engine.attention import install_recording_attention

    check_model_name(name)
    placement = placement_of(device_map, max_memory, offload_folder)
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    started = time.perf_counter()
    path, source = model_path(name)
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise PkvError(f"could not load model {name}: {first_line(exc)}") from None
    check_architecture(config, name)
    architecture = read_architecture(config, name, path if os.path.isdir(path) else None)
    attn_implementation = kernel_of_family(config, architecture, attn_implementation)
    dispatch = placing.dispatch_arguments(placement, device, config) if placement else {}
    try:
        tokenizer = _tokenizer(path)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=getattr(torch, dtype), attn_implementation=attn_implementation, **dispatch
        )
    except (OSError, ValueError, ImportError) as exc:
        placing.remove_with(None, dispatch, placement)
        raise PkvError(f"could not load model {name}: {first_line(exc)}") from None
    if dispatch:
        placing.remove_with(model, dispatch, placement)
        device = str(placing.execution_device(model))  # where its inputs go and its logits come back
    else:
        model.to(device)
    model.eval()
    install_recording_attention(model)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        device=device,
        dtype=dtype,
        attn_implementation=attn_implementation,
        load_s=time.perf_counter() - started,
        source=source,
        architecture=architecture,
        placement=placing.describe(model),
    )


# --- what a model holds, read without loading it ------------------------------------------------------------------


def model_slug(model: str) -> str:
    """A model as one folder name: an alias as it is, a hub id ``org/name`` as ``org--name``, a local folder or
    GGUF file by its name."""
    if is_gguf_file(model) or Path(model).is_dir():
        return Path(model).name.removesuffix(".gguf") or "model"
    return model.replace("/", "--")


def _config_file(model: str) -> Path | None:
    """A local folder's or a hub model's ``config.json`` (the hub's from its cache, or fetched: a few kB)."""
    if Path(model).is_dir():
        return Path(model) / "config.json" if (Path(model) / "config.json").is_file() else None
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(model, "config.json"))
    except Exception:  # offline and not cached, no such model, no access: the model load says which, in one line
        return None


def model_shape(model: str, bits: int) -> ModelShape | None:
    """The cache's shape of ``model`` computing in ``bits`` (its dtype's width), read from its ``config.json`` (a
    GGUF model's float copy's, made by then: building the samples loaded its tokenizer), not its weights; None when
    no config can be read here (the model load then reports what is wrong)."""
    from transformers import AutoConfig

    path = model_path(model)[0]
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, AttributeError, TypeError, ZeroDivisionError):
        return None
    return ModelShape.of(bits, read_architecture(config, model, path if os.path.isdir(path) else None))


def model_context_window(model: str) -> int | None:
    """The positions ``model`` was made for, read from its ``config.json`` or GGUF header without loading it; None
    when that cannot be told (the model load then reports what is wrong with the model).

    A GGUF model's float copy, once made, carries the header's ``context_length`` as ``max_position_embeddings``
    (transformers' GGUF conversion): its ``config.json`` is read instead of the header, which takes seconds to parse
    (gguf-py reads every field, the tokenizer's vocabulary included)."""
    float_copy = cached_float_copy(model)
    if float_copy is None and (model in ALIASES or is_gguf_file(model)):
        return gguf_header(locate_gguf(ALIASES[model]) if model in ALIASES else Path(model)).context_length
    path = _config_file(str(float_copy or model))
    config = read_json(path, "model config") if path is not None else None
    if isinstance(config, dict):  # a model pkvbench cannot run is refused before its tokenizer is used
        check_architecture(SimpleNamespace(**config), model)
        read_architecture(_transformers_config(path, model), model, str(path.parent))
    window = config.get("max_position_embeddings") if isinstance(config, dict) else None
    return window if isinstance(window, int) and window > 0 else None
