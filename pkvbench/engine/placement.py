"""Where a model's modules run when accelerate dispatches it (``--device-map``): the few facts the engine asks of a
placement it did not make.

accelerate's big-model inference places the model: ``from_pretrained(device_map=..., max_memory=...,
offload_folder=...)`` infers a map (``auto``, ``balanced``, ...) or takes one, puts each module's weights on a GPU,
the CPU or the disk, and hooks every module (``accelerate.hooks.AlignDevicesHook``) so that its inputs move to its
*execution device* and offloaded weights (on the CPU or the disk; on the ``meta`` device between forwards) are
brought there for its forward and dropped after. pkvbench writes none of that. What it must keep to:

- each layer's cache, statistics, scores, kept indices and decode-time state live where that layer's attention runs
  (``execution_device`` of its attention module), taken from the tensors at hand wherever there are some; only small
  tensors move (a policy that decides across layers moves its scores to one device; kept indices move to their
  layer);
- nothing reads a module's weights or buffers outside its forward: a module is called (RoPE's tables), or its
  tensor is onloaded for the read through accelerate's own ``align_module_device`` (``onloaded``: attention sinks,
  the output projection CriticalKV weighs values with).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref

import torch

from pkvbench.cell.models import Placement, read_device_map
from pkvbench.errors import PkvError


def _hooks(module: torch.nn.Module) -> list:
    """accelerate's hooks on ``module`` (a ``SequentialHook`` holds several)."""
    hook = getattr(module, "_hf_hook", None)
    return [] if hook is None else list(getattr(hook, "hooks", None) or [hook])


def execution_device(module: torch.nn.Module) -> torch.device:
    """Where ``module`` computes: the execution device of the first accelerate hook on it or inside it (offloaded
    weights are brought there for each forward), else where its weights or buffers are."""
    for inner in module.modules():
        for hook in _hooks(inner):
            device = getattr(hook, "execution_device", None)
            if device is not None:
                return torch.device(device)
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.device.type != "meta":
            return tensor.device
    raise ValueError(f"{type(module).__name__} has neither an execution device nor a weight off the meta device")


def onloaded(module: torch.nn.Module, name: str, device: torch.device | None = None) -> torch.Tensor | None:
    """``module``'s parameter or buffer ``name`` (None where it has none) as its forward sees it: a weight offloaded
    by accelerate is loaded for the read (``align_module_device``) onto its execution device or ``device``; the
    tensor returned stays valid once the module drops its weights again."""
    from accelerate.utils import align_module_device

    if getattr(module, name, None) is None:
        return None
    with align_module_device(module, device):
        tensor = getattr(module, name).detach()
    if tensor.device.type == "meta":
        raise ValueError(f"{type(module).__name__}.{name} is offloaded where accelerate's hooks cannot load it")
    return tensor


def stored(module: torch.nn.Module, name: str) -> torch.Tensor | None:
    """``onloaded``, but a weight accelerate offloaded is read onto the CPU rather than its execution device: for a
    read that needs it once, which must not take the accelerator's memory of every layer at once."""
    from accelerate.utils import has_offloaded_params

    return onloaded(module, name, torch.device("cpu") if has_offloaded_params(module) else None)


def is_dispatched(model: torch.nn.Module) -> bool:
    """Whether accelerate placed the model (``from_pretrained(device_map=...)``)."""
    return getattr(model, "hf_device_map", None) is not None


def cuda_devices(devices) -> list[torch.device]:
    """The CUDA devices among ``devices``, each once (what a synchronisation waits for)."""
    return list(dict.fromkeys(torch.device(d) for d in devices if torch.device(d).type == "cuda"))


def check_tied_weights(device_map: dict, config) -> None:
    """A model whose output layer shares the embedding's weight (``tie_word_embeddings``) keeps that one tensor in one
    place: a map that puts the two modules on different devices would fail at the first forward, so it is refused."""
    if not getattr(config, "tie_word_embeddings", False):
        return

    def device_of(tensor: str):
        holders = [module for module in device_map if module == "" or tensor.startswith(module + ".")]
        return device_map[max(holders, key=len)] if holders else None

    output, embedding = device_of("lm_head.weight"), device_of("model.embed_tokens.weight")
    if output is not None and embedding is not None and output != embedding:
        raise PkvError(
            f"--device-map places lm_head on {output} and model.embed_tokens on {embedding}, but this model's output "
            "layer shares the embedding's weight (tie_word_embeddings): place them on one device"
        )


def dispatch_arguments(placement: Placement, device: str, config=None) -> dict:
    """``from_pretrained``'s keyword arguments for ``placement``: accelerate's device map (a strategy, or the file's
    or mapping's modules), ``max_memory`` (with ``--device cpu``, a strategy's GPUs left out) and the folder weights
    placed on the disk go to (a temporary one, removed with the model, unless given)."""
    device_map = read_device_map(placement.device_map)
    gpus = [] if isinstance(device_map, str) else [d for d in device_map.values() if d not in ("cpu", "disk", "mps")]
    if gpus and not torch.cuda.is_available():
        raise PkvError(f"--device-map places modules on {gpus[0]}, but no CUDA device is available")
    if not isinstance(device_map, str):
        check_tied_weights(device_map, config)
    max_memory = dict(placement.max_memory) if placement.max_memory else None
    if isinstance(device_map, str) and device == "cpu":
        from accelerate.utils import get_max_memory

        max_memory = {k: v for k, v in (max_memory or get_max_memory()).items() if k in ("cpu", "disk")}
    folder = placement.offload_folder
    arguments = {"device_map": device_map, "max_memory": max_memory}
    arguments["offload_folder"] = os.fspath(folder) if folder else tempfile.mkdtemp(prefix="pkvbench-offload-")
    return arguments


def remove_with(model: torch.nn.Module | None, arguments: dict, placement: Placement | None) -> None:
    """A temporary offload folder (``dispatch_arguments``) goes when the model does (now, where none loaded)."""
    if not arguments or placement.offload_folder:
        return
    if model is None:
        shutil.rmtree(arguments["offload_folder"], ignore_errors=True)
    else:
        weakref.finalize(model, shutil.rmtree, arguments["offload_folder"], True)


def describe(model: torch.nn.Module) -> dict | None:
    """What run.json records of a dispatched model's placement: each module's device (or "disk") as accelerate
    placed it; None where the model was not dispatched."""
    if not is_dispatched(model):
        return None
    return {name: str(device) for name, device in model.hf_device_map.items()}
