"""Execution providers this process can run a graph on, and why not the others.

onnxruntime (1.23+) loads execution providers as plugin libraries
(``register_execution_provider_library``), each offering devices (``get_ep_devices``) that
a session takes through ``SessionOptions.add_provider_for_devices``. ortlab knows the
plugins below by their Python package; a plugin that is installed is registered once per
process, and each of its CPU devices becomes a candidate beside the built-in CPU provider.

Why a plugin is not a candidate is kept in words (:func:`plugin_notes`): not installed, it
failed to load, or it offers no device on this machine. The OpenVINO plugin
(``onnxruntime-ep-openvino``) offers only Intel devices (its factory skips other vendors'
hardware), so on an AMD CPU it is not loaded, and the report says why.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import onnxruntime as ort

from ortlab._cache_files import writable
from ortlab.errors import DeviceError, first_line
from ortlab.runtime.openvino import prepare_for_cuda, prepare_for_openvino

__all__ = ["PLUGINS", "KnownPlugin", "PluginEP", "plugin", "plugin_eps", "plugin_notes", "is_plugin", "cpu_candidates",
           "plugin_options", "bf16_provider", "prepare_model"]

logger = logging.getLogger(__name__)

INTEL = 0x8086


@dataclasses.dataclass(frozen=True)
class KnownPlugin:
    """A plugin provider ortlab knows: its package, its session options, the CPU vendors it serves,
    and what its model needs before a session is built on it (``prepare``: bytes in, bytes out)."""

    package: str
    pip_name: str
    options: dict[str, str]
    vendor_ids: frozenset[int] = frozenset()  # empty: any vendor
    prepare: Callable[[bytes], bytes] | None = None


# Note [OpenVINO runs f32 graphs in f32]
# OpenVINO's CPU plugin runs f32 graphs in bf16 on CPUs with AMX/AVX-512-bf16 unless its
# INFERENCE_PRECISION_HINT is f32: a 1024x1024 MatMul then differs from float64 by 2.7e-3
# relative instead of 8e-7, far outside the parity tolerance. The plugin (1.8.1) takes that
# setting only inside its ``load_config`` option (a JSON map per OpenVINO device); given as a
# provider option of its own it is ignored without a word (``precision`` at least logs a
# warning), which an earlier ortlab did on an Intel Xeon with AMX, so f32 was never in force.
# Its factory offers Intel devices only, so on other CPUs it is not even loaded (loading it
# costs ~1 s of shared libraries for nothing).
OPENVINO_CPU_CONFIG = {"INFERENCE_PRECISION_HINT": "f32"}
PLUGINS: dict[str, KnownPlugin] = {
    "OpenVINOExecutionProvider": KnownPlugin("onnxruntime_ep_openvino", "onnxruntime-ep-openvino",
                                             {"load_config": json.dumps({"CPU": OPENVINO_CPU_CONFIG})},
                                             frozenset({INTEL}), prepare=prepare_for_openvino),
}


@dataclasses.dataclass(frozen=True)
class PluginEP:
    """A registered plugin provider with the CPU devices it offers here."""

    name: str
    devices: tuple[Any, ...]  # onnxruntime.OrtEpDevice
    options: dict[str, str]


_LOCK = threading.Lock()
_FOUND: dict[str, PluginEP] = {}
_NOTES: dict[str, str] = {}
_SCANNED: list[bool] = []


def _cpu_device() -> tuple[str, int]:
    """The CPU's vendor name and PCI vendor id, as onnxruntime sees them."""
    try:
        device = next(d.device for d in ort.get_ep_devices() if d.ep_name == "CPUExecutionProvider")
        return device.vendor, device.vendor_id
    except (StopIteration, AttributeError, RuntimeError):
        return "unknown", -1


def _scan() -> None:
    with _LOCK:
        if _SCANNED:
            return
        _SCANNED.append(True)
        if not hasattr(ort, "register_execution_provider_library"):
            for name in PLUGINS:
                _NOTES[name] = f"onnxruntime {ort.__version__} cannot load plugin providers (1.23 or later can)"
            return
        vendor, vendor_id = _cpu_device()
        for name, known in PLUGINS.items():
            if importlib.util.find_spec(known.package) is None:
                _NOTES[name] = f"not installed (pip install {known.pip_name})"
                continue
            if known.vendor_ids and vendor_id not in known.vendor_ids:
                _NOTES[name] = f"{known.pip_name} serves Intel CPUs only, this one is {vendor}"
                continue
            try:
                module = importlib.import_module(known.package)
                ort.register_execution_provider_library(f"ortlab_{known.package}", module.get_library_path())
            except Exception as e:  # noqa: BLE001 - a library that fails to load is noted, never fatal
                _NOTES[name] = f"{known.pip_name} failed to load: {first_line(e, 200)}"
                continue
            devices = tuple(d for d in ort.get_ep_devices()
                            if d.ep_name == name and d.device.type == ort.OrtHardwareDeviceType.CPU)
            if not devices:
                _NOTES[name] = f"{known.pip_name} is installed but offers no device on this CPU ({vendor})"
                continue
            _FOUND[name] = PluginEP(name, devices, dict(known.options))
        for name, note in _NOTES.items():  # once per process; each graph's report line says it too
            logger.info("ortlab: %s is not used: %s", name, note)


def plugin_eps() -> dict[str, PluginEP]:
    """The plugin providers with a CPU device here, by EP name (registered on first use)."""
    _scan()
    return dict(_FOUND)


def plugin_notes() -> dict[str, str]:
    """Why each known plugin provider is not available here, by EP name."""
    _scan()
    return dict(_NOTES)


# Note [OpenVINO's compiled-model cache]
# OpenVINO compiles each graph for the CPU when its session is built (0.1-1 s a graph for
# the GPT). With ``cache_dir`` set, its CACHE_DIR is ``{cache_dir}/openvino``: a later
# process building the same graph loads the compiled blob instead, so a cached start that
# the stored provider decision sends to OpenVINO does not compile again. OpenVINO keys the
# blobs on the model and its settings and manages the folder itself. A folder that stopped
# taking ortlab's writes (Note [A cache folder that stops taking writes]) gets none from
# OpenVINO either.
def plugin_options(ep: PluginEP, cache_dir: str | None) -> dict[str, str]:
    """The provider options a session on ``ep`` is built with (with its compiled-model cache in
    ``cache_dir``, see Note [OpenVINO's compiled-model cache])."""
    if cache_dir is None or ep.name != "OpenVINOExecutionProvider" or not writable(cache_dir):
        return dict(ep.options)
    config = json.loads(ep.options["load_config"])
    config["CPU"] = {**config["CPU"], "CACHE_DIR": os.path.join(cache_dir, "openvino")}
    return {**ep.options, "load_config": json.dumps(config)}


def prepare_model(name: str, model: bytes | str) -> bytes | str:
    """``model`` as the provider ``name`` is given it (Note [Wide MatMuls for OpenVINO]); a path, or a
    provider with nothing to prepare, as it is."""
    if name == "CUDAExecutionProvider" and isinstance(model, bytes):
        return prepare_for_cuda(model)  # Note [Input gradients of convolutions on CUDA]
    known = PLUGINS.get(name)
    if known is None or known.prepare is None or not isinstance(model, bytes):
        return model
    return known.prepare(model)


def is_plugin(name: str) -> bool:
    return name in PLUGINS


def plugin(name: str) -> PluginEP:
    """The plugin provider ``name``.

    Raises:
        DeviceError: when it is not available here, saying why.
    """
    found = plugin_eps().get(name)
    if found is None:
        raise DeviceError(f"{name} was asked for but cannot run here: {plugin_notes().get(name, 'unknown')}")
    return found


def cpu_candidates() -> tuple[list[str], dict[str, str]]:
    """The providers a CPU graph may run on (the CPU provider first), and why the others may not."""
    return ["CPUExecutionProvider", *plugin_eps()], plugin_notes()


def bf16_provider() -> str | None:
    """A plugin provider with bfloat16 kernels on this CPU (OpenVINO where the CPU has AMX or
    AVX-512-bf16: its device says ``BF16`` among its optimization capabilities), or None."""
    for name, ep in plugin_eps().items():
        capabilities = " ".join(str(d.ep_metadata.get("OPTIMIZATION_CAPABILITIES", "")) for d in ep.devices)
        if "BF16" in capabilities.split():
            return name
    return None
